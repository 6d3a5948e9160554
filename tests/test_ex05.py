"""Notebook 05's capstone check: a typical DDP script from the web, fixed, run as two nodes of one (simulated) GPU
each."""
from course_lib.exercises import NOT_ATTEMPTED, PASSED, WRONG, ex05

FIXED = ex05.REFERENCE.read_text()


def variant(tmp_path, name, *replacements):
    text = FIXED
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def test_the_reference_passes_and_the_stub_is_not_attempted(tmp_path):
    assert ex05.check_web_script(ex05.REFERENCE).status == PASSED
    stub = tmp_path / "stub.py"
    stub.write_text("raise NotImplementedError\n")
    assert ex05.check_web_script(stub).status == NOT_ATTEMPTED
    assert ex05.check_web_script(tmp_path / "missing.py").status == WRONG


def test_each_bug_of_the_web_script_is_named(tmp_path):
    init = 'dist.init_process_group(backend="gloo", init_method="env://")'
    set_device = "ex05.set_device(device)                                  # before init_process_group"
    cases = {
        "global rank as device": (('os.environ["LOCAL_RANK"]', 'os.environ["RANK"]'), "LOCAL rank"),
        "set_device after init": ((f"{set_device}\n{init}", f"{init}\nex05.set_device(device)"),
                                  "BEFORE init_process_group"),
        "never destroyed": (("finally:\n    dist.destroy_process_group()", "finally:\n    pass"), "still initialised"),
        "lr not scaled": (("lr = ex05.BASE_LR * dist.get_world_size()", "lr = ex05.BASE_LR"),
                          "scale the learning rate"),
        "lr hard-coded for 2 ranks": (("lr = ex05.BASE_LR * dist.get_world_size()", "lr = 0.02"), "on 3 ranks"),
        "something else changed": (("for epoch in range(3):", "for epoch in range(2):"), "weights differ"),
    }
    for name, (replacement, phrase) in cases.items():
        fb = ex05.check_web_script(variant(tmp_path, name.replace(" ", "_"), replacement))
        assert fb.status == WRONG and phrase in fb.message, (name, fb)
