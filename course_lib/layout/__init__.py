"""Choosing a layout for a real cluster: every DP × TP × PP × CP layout, its memory per GPU, its predicted step time
and MFU, ranked by time (notebook 17, being written)."""
