"""Turn plain-text works into JSONL for tools/preprocess_data.py: one document per scene (or per file).

    python tools/corpus_to_jsonl.py --input-dir texts/ --pattern '*_gut.txt' --output corpus.jsonl --split-scenes
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error  # noqa: E402

SCENE = re.compile(r"^\s*(SCENE|Scene)\s+[\dIVXLC]+\b", re.MULTILINE)


def documents(text: str, split_scenes: bool) -> list[str]:
    if not split_scenes:
        return [text.strip()]
    starts = [m.start() for m in SCENE.finditer(text)]
    if not starts:
        return [text.strip()]
    bounds = [0] + starts + [len(text)]
    return [text[a:b].strip() for a, b in zip(bounds, bounds[1:]) if text[a:b].strip()]


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__)
    p.add_argument("--input-dir", required=True)
    p.add_argument("--pattern", default="*.txt")
    p.add_argument("--output", required=True)
    p.add_argument("--split-scenes", action="store_true")
    args = p.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.input_dir, args.pattern)))
    if not files:
        raise UsageError(f"--input-dir {args.input_dir}: no files match {args.pattern!r}")
    count = 0
    tmp = f"{args.output}.{os.getpid()}.tmp"  # published whole: a failed run leaves no half corpus
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for path in files:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for doc in documents(text, args.split_scenes):
                    out.write(json.dumps({"text": doc, "source": os.path.basename(path)}) + "\n")
                    count += 1
        os.replace(tmp, args.output)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        if exc.filename in files:
            raise UsageError(f"--input-dir {args.input_dir}: cannot read {exc.filename} ({exc.strerror})") from None
        raise UsageError(f"--output {args.output}: cannot write it ({exc.strerror})") from None
    print(f"wrote {count} documents from {len(files)} files to {args.output}")


if __name__ == "__main__":
    main()
