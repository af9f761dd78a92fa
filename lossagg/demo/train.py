"""The demo's training: GRPO on a tiny counting task, per aggregation mode, task and seed.

The task: the prompt is a number k in 1..6; the policy (a GRU cell, ~7k parameters) writes
tokens from {A, B, EOS}; an answer is right when it is exactly k A's and then EOS. Right
answers are k + 1 tokens; wrong ones can ramble up to 16, so how a mode weighs a token by its
answer's length shows in how long the wrong answers grow.

Two variants:

* **single-turn**: a session is one answer, rewarded 1 when right, else 0;
* **multi-turn**: a session is up to :data:`TURNS` answers to one prompt; after a wrong answer
  the policy is told "too few A's", "too many" or "malformed" and answers again; the session
  ends at its first right answer, rewarded 0.5^(turns before it), or after the last turn with 0.
  Every answer is a sample of the step, labelled with its session, so sessions of 1 to 3
  samples meet in one step and the session modes (each session once) weigh differently from
  the sample modes (each answer once).

Each step: sample P prompts x n sessions, group-relative advantages over each prompt's n
sessions (every answer of a session carries its session's advantage), the clipped PG loss per
token, the step split into micro-batches reduced through the plan's micro-batch handle
(``plan.micro_batch`` + ``plan.loss``, as the README teaches), gradients accumulated, one
optimizer step. Each (mode, task, seed) starts from its seed: modes compare on equal footing.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from lossagg.config import LossAggregationConfig
from lossagg.demo import TASKS
from lossagg.modes import MODES, divisor_for
from lossagg.step import StepPlan

A, B, EOS = 0, 1, 2
VOCAB = 3
MAX_LEN = 16
MAX_K = 6
TURNS = TASKS["multi-turn"]  # the multi-turn task's most answers per session
#: the feedback an answer is given on, as the next turn's input (FIRST: the session's first answer)
FIRST, TOO_FEW, TOO_MANY, MALFORMED = range(4)


class Policy(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.prompt = nn.Embedding(MAX_K + 1, hidden)
        self.feedback = nn.Embedding(4, hidden)
        self.token = nn.Embedding(VOCAB + 1, hidden)  # VOCAB = "start"
        self.cell = nn.GRUCell(hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def init(self, k, feedback):
        return torch.tanh(self.prompt(k) + self.feedback(feedback))

    @torch.no_grad()
    def sample(self, k, feedback, generator):
        n = k.shape[0]
        h = self.init(k, feedback)
        prev = torch.full((n,), VOCAB, dtype=torch.long)
        out = torch.full((n, MAX_LEN), EOS, dtype=torch.long)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), MAX_LEN, dtype=torch.long)
        for t in range(MAX_LEN):
            h = self.cell(self.token(prev), h)
            tok = torch.multinomial(torch.softmax(self.head(h), -1), 1, generator=generator).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, EOS), tok)
            out[:, t] = tok
            lengths = torch.where((~done) & (tok == EOS), torch.full_like(lengths, t + 1), lengths)
            done |= tok == EOS
            prev = tok
        return out, lengths

    def logprobs(self, k, feedback, tokens):
        """Log-probability of each token of each answer, [n, MAX_LEN] (teacher forcing)."""
        n = k.shape[0]
        h = self.init(k, feedback)
        prev = torch.full((n,), VOCAB, dtype=torch.long)
        out = []
        for t in range(MAX_LEN):
            h = self.cell(self.token(prev), h)
            out.append(torch.log_softmax(self.head(h), -1).gather(1, tokens[:, t : t + 1]).squeeze(1))
            prev = tokens[:, t]
        return torch.stack(out, 1)


def judge(k, tokens, lengths):
    """(right, the feedback each answer gets): right is exactly k A's, then EOS."""
    inside = torch.arange(MAX_LEN)[None] < lengths[:, None]
    n_a = ((tokens == A) & (torch.arange(MAX_LEN)[None] < lengths[:, None] - 1)).sum(1)
    clean = ((tokens == B) & inside).sum(1) == 0
    ended = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1) == EOS
    right = (n_a == k) & clean & ended
    feedback = torch.where(~(clean & ended), MALFORMED, torch.where(n_a < k, TOO_FEW, TOO_MANY))
    return right, torch.where(right, FIRST, feedback)


def demo_settings(mode: str) -> dict:
    """Extra settings a mode needs in the demo: a constant divisor is the longest answer."""
    divisor = divisor_for(MODES[mode], default=MAX_LEN, default_name="the demo's MAX_LEN")
    return {} if divisor is None else {"divisor": divisor}


def rollout(policy, turns, prompts_per_step, n, generator):
    """One step's answers: P prompts x n sessions of up to ``turns`` answers each, one row per answer,
    each session's rows together. Returns the rows' tensors and the sessions' rewards."""
    sessions = prompts_per_step * n
    k = torch.randint(1, MAX_K + 1, (prompts_per_step,), generator=generator).repeat_interleave(n)
    reward = torch.zeros(sessions)
    active, feedback = torch.arange(sessions), torch.full((sessions,), FIRST, dtype=torch.long)
    rows = []
    for turn in range(turns):
        tokens, lengths = policy.sample(k[active], feedback[active], generator)
        right, told = judge(k[active], tokens, lengths)
        turn_of = torch.full_like(active, turn)
        rows.append(dict(session=active, turn=turn_of, k=k[active], feedback=feedback[active], tokens=tokens, lengths=lengths, right=right))
        reward[active[right]] = 0.5**turn
        feedback[active] = told
        active = active[~right]
        if active.numel() == 0:
            break
    batch = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
    order = torch.argsort(batch["session"] * TURNS + batch["turn"])  # a session's answers together, in turn order
    batch = {key: value[order] for key, value in batch.items()}
    g = reward.view(prompts_per_step, n)
    session_adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1)
    batch["adv"] = session_adv[batch["session"]]
    batch["group_index"] = batch["session"] // n
    batch["mask"] = torch.arange(MAX_LEN)[None] < batch["lengths"][:, None]
    with torch.no_grad():
        batch["old_logp"] = policy.logprobs(batch["k"], batch["feedback"], batch["tokens"])
    return batch, reward


def make_plan(config, batch):
    return StepPlan(config, batch["lengths"], group_index=batch["group_index"], session_index=batch["session"])


def pg_step(policy, batch, plan, micro_batches, clip):
    """Gradients of J accumulated over the step's micro-batches, each reduced through the plan's handle
    (padded [B, MAX_LEN] layout); returns J."""
    total = 0.0
    for rows in torch.tensor_split(torch.arange(batch["k"].shape[0]), micro_batches):
        if rows.numel() == 0:
            continue
        logp = policy.logprobs(batch["k"][rows], batch["feedback"][rows], batch["tokens"][rows])
        ratio = torch.exp(logp - batch["old_logp"][rows])
        adv = batch["adv"][rows][:, None]
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        mb = plan.micro_batch(rows, batch["mask"][rows])
        loss = plan.loss(per_token, mb)
        loss.backward()
        total += float(loss.detach())
    return total


def split_check(policy, config, batch, clip):
    """One step's gradient unsplit vs split into 4 micro-batches, relative to its largest entry
    (None when every advantage is 0: nothing to compare)."""
    grads = []
    for micro_batches in (1, 4):
        policy.zero_grad()
        pg_step(policy, batch, make_plan(config, batch), micro_batches, clip)
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
    policy.zero_grad()
    scale = float(grads[0].abs().max())
    return None if scale == 0.0 else float((grads[0] - grads[1]).abs().max()) / scale


def _mean_or_nan(values: torch.Tensor) -> float:
    return float(values.float().mean()) if values.numel() else math.nan


def config_for(mode: str, task: str, args) -> LossAggregationConfig:
    """The run's config: the user's for its mode (``--config``), else the mode with the demo's settings. A prompt
    group of the multi-turn task is n sessions of 1 to 3 answers, not n samples: there the config promises no
    group size (n_samples_per_prompt unset; the plan reads the groups from their labels)."""
    if args.config_obj is not None and args.config_obj.mode == mode:
        config = args.config_obj
    else:
        config = LossAggregationConfig(mode=mode, n_samples_per_prompt=args.n_samples_per_prompt, **demo_settings(mode))
    if TASKS[task] > 1 and config.n_samples_per_prompt is not None:
        config = LossAggregationConfig.model_validate({**config.model_dump(), "n_samples_per_prompt": None})
    return config


def train_run(task: str, mode: str, seed: int, args, *, check_split: bool = False) -> dict:
    """One training run: the per-step history (reward: the sessions' mean reward; wrong_length and
    right_length: the mean token count of the step's wrong and right answers, NaN when it has none;
    turns: answers per session) and, with ``check_split``, the split check of a mid-training step."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    config = config_for(mode, task, args)
    history = {"reward": [], "wrong_length": [], "right_length": [], "turns": []}
    split = None
    began = time.perf_counter()
    for step in range(args.steps):
        batch, reward = rollout(policy, TASKS[task], args.prompts_per_step, args.n_samples_per_prompt, generator)
        if check_split and split is None and step >= args.steps // 2:
            split = split_check(policy, config, batch, args.clip)
        opt.zero_grad()
        pg_step(policy, batch, make_plan(config, batch), args.micro_batches, args.clip)
        opt.step()
        history["reward"].append(float(reward.mean()))
        history["wrong_length"].append(_mean_or_nan(batch["lengths"][~batch["right"]]))
        history["right_length"].append(_mean_or_nan(batch["lengths"][batch["right"]]))
        history["turns"].append(batch["k"].shape[0] / reward.shape[0])
    if check_split and split is None:
        # every advantage was 0 on every checked step (a collapsed policy): the split checked on the
        # last step with random advantages instead
        batch["adv"] = torch.randn(batch["adv"].shape, generator=generator)
        split = split_check(policy, config, batch, args.clip)
    return {"task": task, "mode": mode, "seed": seed, "history": history, "split": split, "seconds": time.perf_counter() - began}
