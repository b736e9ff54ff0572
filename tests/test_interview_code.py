"""distlab.lab.interview_code: the interview answers' code, run as quoted in fresh processes,
fails the way this machine's PyTorch makes it fail, and the verdict follows the run: a
corrected snippet (a timedelta) runs and reads yes."""

import pytest

from distlab.lab import interview_code as ic


@pytest.fixture(scope="module")
def outcomes():
    return ic.run_all()


@pytest.mark.parametrize("name,said", [
    ("timeout", "TypeError: Expected timeout argument to be of type datetime.timedelta"),
    ("fsdp_string", "KeyError: 'FULL_SHARD'"),
    ("fsdp_checkpointing", "unexpected keyword argument 'activation_checkpointing'"),
    ("deepspeed_import", "SyntaxError"),
    ("deepspeed_initialize", "SyntaxError: invalid syntax (<the answer>, line 1): the block "
                             "stops before DeepSpeed.initialize runs"),
    ("launch", "torch.distributed.launch is deprecated"),
])
def test_the_quoted_code_does_not_do_what_the_answer_says(outcomes, name, said):
    assert said in outcomes[name]["said"], outcomes[name]
    assert not ic.holds(name, outcomes[name])
    (row,) = ic.claim_rows({name: outcomes[name]})
    assert row["holds"] is False and said.split(":")[0] in row["figure"]


def test_the_corrected_code_runs_and_reads_yes():
    fixed = ic.run(ic._PG + "import datetime\n"
                            "dist.init_process_group('gloo', rank=0, world_size=1, "
                            "timeout=datetime.timedelta(minutes=30))\nprint('ok')")
    assert fixed == {"ok": True, "said": "ok"} and ic.holds("timeout", fixed)
