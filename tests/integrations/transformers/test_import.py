"""transformers is optional: only ``attnpool.integrations.transformers`` imports it."""

from __future__ import annotations

import subprocess
import sys


def test_import_attnpool_does_not_import_transformers() -> None:
    code = ("import sys, attnpool, attnpool.integrations, attnpool.integrations.engine, "
            "attnpool.kv, attnpool.tools.bench_e2e, "
            "attnpool.tools.cli, attnpool.tools.demo\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\n"
            "import attnpool.integrations.transformers\n"
            "assert 'transformers' in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr


def test_importing_the_integration_registers_the_attention() -> None:
    from transformers import AttentionInterface

    from attnpool.integrations.transformers import ATTN_NAME, attnpool_attention

    assert ATTN_NAME == "attnpool"
    assert AttentionInterface()[ATTN_NAME] is attnpool_attention
