"""Runs the Unsloth guide's quickstart block (``docs/frameworks/unsloth.md``), in Unsloth's
environment.

``tests/test_docs.py::test_unsloth_quickstart`` starts it, in an empty working directory::

    UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --frozen --only-group unsloth \\
        python tests/docs_blocks/unsloth_block.py BLOCK.py

It supplies the reader's code the block names (a tiny Llama built locally by
``integrations/unsloth/tests/unsloth_testkit.py``: nothing is downloaded), executes the
block, which calls its ``train`` task, and prints one line, ``RESULT {...}``: the taskpoint
attempt of every forward pass of the model, and the ``checkpoint-N`` directories left in the
output directory. The model's forward pass number ``CRASH_AT`` raises once, as a dying
attempt would; the test checks that the retry resumed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "integrations" / "unsloth" / "tests"))

import taskpoint  # noqa: E402
import unsloth_testkit as kit  # noqa: E402  (sets HF offline mode, imports Unsloth first)

CRASH_AT = 7
"""Attempt 0 dies in step 7 of 10 (checkpoints every 4 steps)."""

forwards: list[int] = []


def _count(module: Any, args: Any) -> None:
    context = taskpoint.ctx()
    assert context is not None and context.attempt is not None
    forwards.append(context.attempt)
    if len(forwards) == CRASH_AT:
        raise RuntimeError(f"simulated crash in forward pass {CRASH_AT}")


def load_lora_model() -> tuple[Any, Any]:
    """The reader's ``FastLanguageModel.from_pretrained`` + ``get_peft_model``."""
    model, tokenizer = kit.load_lora_model(BASE)
    model.register_forward_pre_hook(_count)
    return model, tokenizer


def make_sft_config() -> Any:
    """The reader's ``SFTConfig``: 10 steps, a checkpoint every 4, two kept."""
    return kit.sft_args(Path("out"), max_steps=10, save_steps=4, save_total_limit=2)


def make_dataset() -> Any:
    """The reader's training data."""
    from datasets import Dataset

    return Dataset.from_dict({"text": kit.SENTENCES * 2})


if __name__ == "__main__":
    BASE = kit.make_base_model(Path("base").resolve())
    block = Path(sys.argv[1])
    namespace: dict[str, Any] = {
        "__name__": "docs_unsloth_block",
        "load_lora_model": load_lora_model,
        "make_sft_config": make_sft_config,
        "make_dataset": make_dataset,
    }
    exec(compile(block.read_text(), "docs/frameworks/unsloth.md", "exec"), namespace)  # calls train()
    checkpoints = sorted(p.name for p in Path("out").glob("checkpoint-*"))
    print("RESULT " + json.dumps({"forwards": forwards, "checkpoints": checkpoints}), flush=True)
