"""Code generation with RL (PPO; GRPO in the offline run): the policy completes Python functions,
rewarded by the fraction of their unit tests that the generated code passes.

Each task is a function stub (signature and docstring) with assert-based tests. The policy either
continues the stub (``prompt_style="completion"``, base models: the program is the stub plus the
completion, cut where top-level code starts, with the Codex paper's stop sequences) or answers a
chat request with a fenced code block (``prompt_style="chat"``, instruct models: the program is
the stub followed by the block, whose function replaces the stub's). The program and the tests
run in :mod:`examples.code_sandbox` (a separate, limited, disposable process per program, several
in parallel): a completion that loops, crashes or exits early scores what its tests honestly
passed, usually 0 (the sandbox's docstring says which hostile actions each platform stops).

Data: JSONL records ``{"prompt": <stub>, "tests": ["assert f(1) == 2", ...]}`` (the bundled
``data/code_tasks.jsonl``, 32 small functions written for this project, each with a reference
``solution`` that passes its tests, in at most 64 tokens of the tiny model's tokenizer), or the
Hub datasets MBPP (``google-research-datasets/mbpp``: ``text``, ``code``, ``test_list``) and
HumanEval (``openai/openai_humaneval``: ``prompt``, ``test``, ``entry_point``; one test:
``check``). :func:`code_record` turns a row into the prompt record
``{"prompt": stub, "tests": [...], "solution": body or None}``.

Run: ``python -m examples.code_generation`` (offline: the embedded tiny model, first fine-tuned
on the training tasks' reference solutions, :func:`code_sft_record`; it learns those, not to
solve unseen tasks), or ``--model <dir or repo id>``.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import logging
import re
import sys
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from config.ppo_config import PPOConfig
from examples.task_common import DATA_DIR, run_task_cli, task_argument_parser
from finetune.records import require_object, require_text
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.prompt_records import Prompt, PromptInput
from sandbox import SandboxLimits, extract_code, score_completions

logger = logging.getLogger("ppo_mlx")

BUNDLED_DATA = DATA_DIR / "code_tasks.jsonl"
PromptStyle = Literal["completion", "chat"]
CHAT_REQUEST = (
    "Complete this Python function. Reply with the whole function in a ```python code block."
    "\n\n{stub}"
)
#: A completion of a stub ends at the first of these (top-level code after the function).
STOP_SEQUENCES: tuple[str, ...] = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "```")
_OPEN_FENCE = re.compile(r"```[ \t]*[\w+-]*[^\n]*\n")

#: PPO settings of the command line (overridable with --set or --config).
TASK_DEFAULTS: dict[str, Any] = dict(
    max_new_tokens=64,
    batch_size=4,
    learning_rate=1e-4,
    num_ppo_epochs=2,
    num_mini_batches=2,
    kl_coef=0.05,
    temperature=0.7,
    total_steps=20,
)
#: SFT of the embedded tiny model (no --model) on the reference solutions, before PPO: enough to
#: pass the tests of about a third of the samples of the training prompts, and short enough to
#: leave room for the RL stage: at 50 steps the policy passes ~80% (near its ceiling) and RL
#: has little left to raise.
SFT_SETTINGS: dict[str, Any] = dict(
    learning_rate=3e-3, batch_size=8, total_steps=30, warmup_steps=2, progress_bar=True
)
#: RL settings of the embedded tiny model's run (over TASK_DEFAULTS): GRPO, whose baseline is the
#: mean score of 4 programs for the same stub, so that an advantage says which attempt at a
#: function is better rather than which function is easy (PPO's value head starts untrained;
#: with PPO the reward stayed within the noise). 4 optimisation passes over each batch of 16
#: programs. The evaluations sample at the training temperature, as the rollouts do.
TINY_DEFAULTS: dict[str, Any] = dict(
    algorithm="grpo",
    group_size=4,
    max_new_tokens=64,
    batch_size=4,
    learning_rate=1e-3,
    num_ppo_epochs=4,
    total_steps=30,
    eval_temperature=0.7,
)
#: Samples of each prompt in the evaluations before and after RL (4 rather than the shared 2: a
#: standard error of the change of the mean reward sqrt(2) times smaller).
EVAL_SAMPLES_PER_PROMPT = 4


# --------------------------------------------------------------------------- the reward


def build_program(stub: str, completion: str) -> str:
    """The program a completion stands for.

    A completion with a fenced code block (a chat answer) is the stub followed by the block's
    code (:func:`examples.code_sandbox.extract_code`), which redefines the function. Otherwise it
    continues the stub: the stub plus the completion up to the first of :data:`STOP_SEQUENCES`.
    """
    if _OPEN_FENCE.search(completion):
        return f"{stub}\n{extract_code(completion)}\n"
    ends = [i for i in (completion.find(s) for s in STOP_SEQUENCES) if i >= 0]
    return stub + completion[: min(ends, default=len(completion))]


def score_programs(
    stubs: Sequence[str],
    completions: Sequence[str],
    tests: Sequence[Sequence[str]],
    *,
    limits: SandboxLimits | None = None,
    max_workers: int | None = None,
) -> list[float]:
    """Fraction of its tests each completion's program (:func:`build_program`) passes, in [0, 1].

    Runs :func:`examples.code_sandbox.score_completions`: one sandbox per program, at most
    ``max_workers`` at once (default: half the CPU cores).
    """
    if not len(stubs) == len(completions) == len(tests):
        raise ValueError(
            f"stubs, completions and tests must have one entry per program, got {len(stubs)}, "
            f"{len(completions)} and {len(tests)}"
        )
    programs = [build_program(s, c) for s, c in zip(stubs, completions)]
    return score_completions(programs, tests, limits=limits, max_workers=max_workers)


# --------------------------------------------------------------------------- the data


_FIELDS = "a task has 'prompt' and 'tests', or MBPP/HumanEval columns"
_MBPP_FIELDS = "an MBPP row has 'text', 'code' and 'test_list'"
_HUMANEVAL_FIELDS = "a HumanEval row has 'prompt', 'test' and 'entry_point'"


def _mbpp_stub(record: Mapping[str, Any], where: str) -> str:
    """MBPP: the reference solution's ``def`` line of the function the first test calls, with the
    task text as its docstring."""
    text = require_text(record, "text", where, _MBPP_FIELDS)
    code = require_text(record, "code", where, _MBPP_FIELDS)
    called = re.findall(r"\b([A-Za-z_]\w*)\s*\(", record["test_list"][0])
    for match in re.finditer(r"^def\s+(\w+)\s*\(.*?\)\s*(->[^:]*)?:", code, re.M | re.S):
        if match.group(1) in called:
            docstring = text.strip().replace('"""', "'''")
            return f'{match.group(0)}\n    """{docstring}"""\n'
    raise ValueError(
        f"{where}: the 'code' field defines none of the functions its first test calls"
    )


def code_record(record: Any, where: str) -> dict[str, Any]:
    """The prompt record of a row (bundled, MBPP or HumanEval format): ``{"prompt": stub,
    "tests": [snippet, ...], "solution": body}``, where the stub (signature and docstring) ends
    with a newline and ``solution`` is a reference body that continues it (the bundled
    ``solution``, HumanEval's ``canonical_solution``; None for MBPP, whose ``code`` is a whole
    program).

    Raises:
        ValueError: ``"<where>: ..."`` for a malformed record or a test that does not compile.
    """
    record = require_object(record, where, _FIELDS)
    solution = None
    if "tests" in record:
        stub, tests = require_text(record, "prompt", where, _FIELDS), record["tests"]
        if record.get("solution") is not None:
            solution = require_text(record, "solution", where, "a reference body for the stub")
    elif "test_list" in record:  # MBPP
        tests = record["test_list"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"{where}: 'test_list' must be a non-empty list of test snippets")
        stub = _mbpp_stub(record, where)
        setup = record.get("test_setup_code") or ""
        tests = [f"{setup}\n{t}" if setup else t for t in tests]
    elif "entry_point" in record:  # HumanEval: one test, its check() function
        stub = require_text(record, "prompt", where, _HUMANEVAL_FIELDS)
        test = require_text(record, "test", where, _HUMANEVAL_FIELDS)
        entry_point = require_text(record, "entry_point", where, _HUMANEVAL_FIELDS)
        tests = [f"{test}\ncheck({entry_point})"]
        if record.get("canonical_solution") is not None:
            solution = require_text(record, "canonical_solution", where, _HUMANEVAL_FIELDS)
    else:
        raise ValueError(f"{where}: {_FIELDS}; found fields {sorted(record)}")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"{where}: 'tests' must be a non-empty list of test snippets (strings)")
    for i, test in enumerate(tests):
        try:
            compile(test, f"<test {i}>", "exec")
        except SyntaxError as err:
            raise ValueError(f"{where}: tests[{i}] does not compile: {err.msg}") from err
    stub = stub if stub.endswith("\n") else stub + "\n"
    return {"prompt": stub, "tests": list(tests), "solution": solution}


def code_sft_record(
    record: Mapping[str, Any], prompt_style: PromptStyle = "completion"
) -> dict[str, Any] | None:
    """The SFT record of a prompt record with a reference ``solution`` (None without one): the
    stub continued by the solution ("completion"), or the chat request answered by the whole
    function in a code block ("chat")."""
    if record.get("solution") is None:
        return None
    stub, solution = record["prompt"], record["solution"]
    if prompt_style == "completion":
        return {"prompt": stub, "completion": solution}
    answer = f"```python\n{stub}{solution.rstrip()}\n```"
    request = {"role": "user", "content": CHAT_REQUEST.format(stub=stub)}
    return {"messages": [request, {"role": "assistant", "content": answer}]}


# --------------------------------------------------------------------------- the trainer


class CodeGenerationTrainer(PPOTrainer):
    """PPO on function stubs, rewarded by the fraction of unit tests the code passes.

    Trains on prompt records ``{"prompt": stub, "tests": [...], ...}`` (:func:`code_record`).
    Overrides :meth:`format_prompt` (the stub, or a chat request for it) and :meth:`evaluate`
    (adds ``eval/pass_rate``). The reward, :meth:`test_reward`, runs every program in the code
    sandbox; the config must name no reward model.

    Args:
        config: the run configuration.
        prompt_style: "completion" (the policy continues the stub) or "chat" (the policy answers
            a chat request with a code block; needs a chat template).
        limits: sandbox limits per program; default: ``SandboxLimits()``.
        max_workers: programs run at once; None = half the CPU cores.
        **components: ``policy``, ``ref_model``, ``value_model``, ``tokenizer``, as for
            :class:`PPOTrainer` (the reward is the tests').
    """

    def __init__(
        self,
        config: PPOConfig,
        *,
        prompt_style: PromptStyle = "completion",
        limits: SandboxLimits | None = None,
        max_workers: int | None = None,
        **components: Any,
    ) -> None:
        if config.reward_model_name is not None or "reward_model" in components:
            raise ValueError(
                "the code-generation reward is the unit tests' pass rate: unset "
                "reward_model_name and pass no reward_model"
            )
        if prompt_style not in ("completion", "chat"):
            raise ValueError(f'prompt_style must be "completion" or "chat", got {prompt_style!r}')
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1 or None, got {max_workers}")
        self.prompt_style = prompt_style
        self.limits = limits or SandboxLimits()
        self.max_workers = max_workers
        super().__init__(config, reward_model=self.test_reward, **components)

    def format_prompt(self, prompt: Prompt) -> str:
        """The stub itself ("completion"), or a chat request for it in the chat template."""
        if not isinstance(prompt, str):
            raise ValueError("CodeGenerationTrainer prompts are function stubs, not chat messages")
        if self.prompt_style == "completion":
            return prompt
        return super().format_prompt(
            [{"role": "user", "content": CHAT_REQUEST.format(stub=prompt)}]
        )

    def test_reward(
        self,
        prompts: list[str],
        completions: list[str],
        prompt: list[str],
        tests: list[Sequence[str]],
    ) -> list[float]:
        """:func:`score_programs` of each completion of a stub (the ``prompt`` column) against its
        ``tests`` (in parallel)."""
        return score_programs(
            prompt, completions, tests, limits=self.limits, max_workers=self.max_workers
        )

    def evaluate(
        self,
        prompts: Sequence[PromptInput],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        num_samples: int = 4,
    ) -> dict[str, Any]:
        """:meth:`PPOTrainer.evaluate` plus ``eval/pass_rate``: the share of programs that pass
        every test (pass@1 at the evaluation temperature)."""
        result = super().evaluate(prompts, max_new_tokens, temperature, num_samples=len(prompts))
        samples = result["samples"]
        result["eval/pass_rate"] = float(np.mean([s["reward"] == 1.0 for s in samples]))
        result["samples"] = samples[:num_samples]
        return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m examples.code_generation [--model DIR] [--steps N] ...``"""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = task_argument_parser(__doc__.split("\n\n")[0], BUNDLED_DATA)
    parser.add_argument("--prompt-style", choices=("completion", "chat"), default="completion")
    parser.add_argument("--workers", type=int, help="sandboxes run at once (default: cores / 2)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per program")
    parser.add_argument(
        "--sandbox-isolation",
        choices=("strong", "weak"),
        default="strong",
        help="'weak' also runs where the kernel gives no namespaces (macOS, user namespaces "
        "disabled); it warns what it does not protect (docs/reliability.md)",
    )
    args = parser.parse_args(argv)
    return run_task_cli(
        args,
        to_record=code_record,
        task_defaults=TASK_DEFAULTS,
        default_output_dir="runs/code_generation",
        to_sft=lambda record: code_sft_record(record, args.prompt_style),
        sft_settings=SFT_SETTINGS,
        tiny_defaults=TINY_DEFAULTS,
        eval_samples_per_prompt=EVAL_SAMPLES_PER_PROMPT,
        build=lambda config: CodeGenerationTrainer(
            config,
            prompt_style=args.prompt_style,
            limits=SandboxLimits(timeout_s=args.timeout, isolation=args.sandbox_isolation),
            max_workers=args.workers,
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
