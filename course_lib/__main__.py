"""``python -m course_lib doctor`` (the preflight) and ``python -m course_lib map`` (the course map)."""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    if command == "doctor":
        from .doctor import main as doctor
        return doctor(argv[1:])
    if command == "map" and argv[1:] == ["--frames"]:
        from .course_map import write_frames
        for name in write_frames():
            print("updated", name)
        return 0
    if command == "map":
        from .course_map import markdown_table
        print(markdown_table())
        return 0
    print("usage: python -m course_lib doctor [--no-smoke]   the preflight: what runs on this machine\n"
          "       python -m course_lib map                   the course map, as a Markdown table\n"
          "       python -m course_lib map --frames          each notebook's links and learner time, from the map",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
