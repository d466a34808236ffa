"""``python -m quamba.eval``: lm-eval's command line with the ``quamba`` model registered.

lm-eval finds models only in modules it has imported, so plain ``lm_eval --model quamba`` cannot
see quamba's adapter; this entry point imports it first and then hands over to lm-eval::

    python -m quamba.eval --model quamba --model_args pretrained=DIR,batch_size=16 \\
        --tasks lambada_openai,piqa --device cpu --task_data ../shared/data/eval

``--task_data DIR`` (default: the environment variable QUAMBA_TASK_DATA) adds the offline tasks
of DIR (see quamba.eval.tasks) through lm-eval's ``--include_path``; every other argument is
lm-eval's own.
"""
import os
import sys
import tempfile

from lm_eval.__main__ import cli_evaluate

import quamba.eval.lm  # noqa: F401  registers the "quamba" model
from quamba.eval.tasks import write_offline_task_yamls


def split_task_data(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--task_data DIR`` / ``--task-data=DIR``, and DIR (or the environment's)."""
    rest, task_data = [], os.environ.get("QUAMBA_TASK_DATA")
    args = iter(argv)
    for arg in args:
        name, equals, value = arg.partition("=")
        if name in ("--task_data", "--task-data"):
            task_data = value if equals else next(args, None)
        else:
            rest.append(arg)
    return rest, task_data


def main() -> None:
    argv, task_data = split_task_data(sys.argv[1:])
    if not task_data:
        sys.argv = [sys.argv[0], *argv]
        cli_evaluate()
        return
    with tempfile.TemporaryDirectory(prefix="quamba-tasks-") as yaml_dir:
        write_offline_task_yamls(task_data, yaml_dir)
        sys.argv = [sys.argv[0], *argv, "--include_path", yaml_dir]
        cli_evaluate()


if __name__ == "__main__":
    main()
