"""gpt-oss on two tensor-parallel ranks, served end to end (`pagewire serve -tp 2`): each
rank its query heads' sinks and its share of every expert's rows (gate_up's bias split with
them, down's added by rank 0), or with --enable-expert-parallel whole experts apart; greedy
tokens as transformers'."""
from __future__ import annotations

import pytest

from pagewire.testing.server import TWO_RANKS, running_server
from tests.actors.test_gpt_oss import TIGHT, make_gpt_oss
from tests.e2e.test_tensor_parallel import F32, assert_matches_transformers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_gpt_oss_ranks_match_transformers(tmp_path, smol_tokenizer_dir, expert_parallel):
    path = make_gpt_oss(str(tmp_path / "m"), smol_tokenizer_dir, **TIGHT)
    extra = ["--enable-expert-parallel"] if expert_parallel else []
    with running_server([path, *F32, *TWO_RANKS, *extra]) as srv:
        assert_matches_transformers(srv, path)
