"""Coverage-guided fuzzing (atheris / libFuzzer) of the same parsers as ``test_fuzz.py``.

The pytest test runs this file as a subprocess for a bounded number of runs and seconds, starting
from a corpus of valid objects of every kind; libFuzzer exits non-zero on the first input that
makes a parser raise anything but ``FormatError``, and prints it. Run longer by hand with::

    python tests/test_fuzz_atheris.py -max_total_time=600 CORPUS_DIR
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

RUNS = 500_000
SECONDS = 30


def test_atheris_finds_no_crash(tmp_path: Path) -> None:
    from test_fuzz import SEEDS

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, (_kind, data) in enumerate(sorted(SEEDS.items())):
        (corpus / f"seed-{i}").write_bytes(bytes([i]) + data)
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            f"-runs={RUNS}",
            f"-max_total_time={SECONDS}",
            "-rss_limit_mb=1024",
            "-timeout=10",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, (
        f"atheris found a crash:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
    )
    assert "Done" in proc.stderr, proc.stderr[-2000:]


def _main() -> None:  # pragma: no cover - runs in the atheris subprocess
    import atheris

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with atheris.instrument_imports(include=["batchweave"]):
        from test_fuzz import PARSERS

        from batchweave import FormatError

    parsers = [PARSERS[k] for k in sorted(PARSERS)]

    def one_input(data: bytes) -> None:
        if not data:
            return
        parse = parsers[data[0] % len(parsers)]
        with contextlib.suppress(FormatError):
            parse(data[1:])

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    _main()
