"""The demo's training: GRPO on a tiny counting task, once per aggregation mode.

The task: the prompt is a number k in 1..6; the policy (a GRU cell, ~6.8k parameters)
writes tokens from {A, B, EOS}; the reward is 1 when it writes exactly k A's and then
EOS, else 0. Wrong answers tend to ramble (up to 16 tokens), right ones are short, so
the modes' length weighting matters. Each step: sample P prompts x n samples, compute
group-relative advantages, the clipped PG loss per token, split the step into
micro-batches, aggregate through lossagg (StepPlan + reduce), accumulate gradients,
step the optimizer. Every mode starts from the same seed.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from lossagg.config import LossAggregationConfig
from lossagg.layout import cu_seqlens_from_lengths
from lossagg.modes import MODES, divisor_for
from lossagg.step import StepPlan

A, B, EOS = 0, 1, 2
VOCAB = 3
MAX_LEN = 16
MAX_K = 6


class Policy(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.prompt = nn.Embedding(MAX_K + 1, hidden)
        self.token = nn.Embedding(VOCAB + 1, hidden)  # VOCAB = "start"
        self.cell = nn.GRUCell(hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def step(self, h, prev):
        h = self.cell(self.token(prev), h)
        return h, self.head(h)

    def init(self, k):
        return torch.tanh(self.prompt(k))

    @torch.no_grad()
    def sample(self, k, generator):
        n = k.shape[0]
        h = self.init(k)
        prev = torch.full((n,), VOCAB, dtype=torch.long)
        out = torch.full((n, MAX_LEN), EOS, dtype=torch.long)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), MAX_LEN, dtype=torch.long)
        for t in range(MAX_LEN):
            h, logits = self.step(h, prev)
            tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, EOS), tok)
            out[:, t] = tok
            newly = (~done) & (tok == EOS)
            lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
            done |= tok == EOS
            prev = tok
        return out, lengths

    def logprobs(self, k, tokens):
        """Log-probability of each token of each response, [n, MAX_LEN] (teacher forcing)."""
        n = k.shape[0]
        h = self.init(k)
        prev = torch.full((n,), VOCAB, dtype=torch.long)
        out = []
        for t in range(MAX_LEN):
            h, logits = self.step(h, prev)
            out.append(torch.log_softmax(logits, -1).gather(1, tokens[:, t : t + 1]).squeeze(1))
            prev = tokens[:, t]
        return torch.stack(out, 1)


def rewards_for(k, tokens, lengths):
    n_a = ((tokens == A) & (torch.arange(MAX_LEN)[None] < lengths[:, None] - 1)).sum(1)
    clean = ((tokens == B) & (torch.arange(MAX_LEN)[None] < lengths[:, None])).sum(1) == 0
    ended = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1) == EOS
    return ((n_a == k) & clean & ended).float()


def demo_settings(mode: str) -> dict:
    """Extra settings a mode needs in the demo: a constant divisor is the longest response."""
    divisor = divisor_for(MODES[mode], default=MAX_LEN, default_name="the demo's MAX_LEN")
    return {} if divisor is None else {"divisor": divisor}


def pack(x, lengths):
    """Padded [n, MAX_LEN] -> packed [T] and cu_seqlens."""
    keep = torch.arange(MAX_LEN)[None] < lengths[:, None]
    cu = cu_seqlens_from_lengths(lengths)
    return x[keep], cu


def pg_step_loss(policy, batch, plan, micro_batches, clip):
    """Accumulate gradients of J over micro-batches; returns (J, seconds in aggregation)."""

    n = batch["k"].shape[0]
    total = 0.0
    agg_seconds = 0.0
    for mb in torch.tensor_split(torch.arange(n), micro_batches):
        logp = policy.logprobs(batch["k"][mb], batch["tokens"][mb])
        ratio = torch.exp(logp - batch["old_logp"][mb])
        adv = batch["adv"][mb][:, None]
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        values, cu = pack(per_token, batch["lengths"][mb])
        mask, _ = pack(batch["mask"][mb], batch["lengths"][mb])
        t0 = time.perf_counter()
        loss = plan.loss(values, mask, mb, cu)
        agg_seconds += time.perf_counter() - t0
        loss.backward()
        total += float(loss.detach())
    return total, agg_seconds


def rollout(policy, prompts_per_step, n, generator):
    k = torch.randint(1, MAX_K + 1, (prompts_per_step,), generator=generator).repeat_interleave(n)
    tokens, lengths = policy.sample(k, generator)
    r = rewards_for(k, tokens, lengths)
    g = r.view(prompts_per_step, n)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1)
    with torch.no_grad():
        old_logp = policy.logprobs(k, tokens)
    mask = torch.arange(MAX_LEN)[None] < lengths[:, None]
    group_index = torch.arange(prompts_per_step).repeat_interleave(n)
    # the task is single-turn: each rollout is a session of one sample, so a session mode is its one-sample form
    session_index = torch.arange(prompts_per_step * n)
    return dict(
        k=k, tokens=tokens, lengths=lengths, reward=r, adv=adv, old_logp=old_logp, mask=mask, group_index=group_index, session_index=session_index
    )


def invariance_check(policy, config, batch, clip):
    """One step's gradient unsplit vs split into 4 micro-batches: the same up to float error."""
    grads = []
    for micro_batches in (1, 4):
        policy.zero_grad()
        plan = StepPlan(config, batch["lengths"], group_index=batch["group_index"], session_index=batch["session_index"])
        pg_step_loss(policy, batch, plan, micro_batches, clip)
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
    policy.zero_grad()
    scale = float(grads[0].abs().max())
    if scale == 0.0:
        return None  # every advantage is 0: nothing to compare on this step
    return float((grads[0] - grads[1]).abs().max()) / scale


def train_mode(mode, args, progress):
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    n = args.n_samples_per_prompt
    if args.config_obj is not None and args.config_obj.mode == mode:
        config = args.config_obj
    else:
        config = LossAggregationConfig(mode=mode, n_samples_per_prompt=n, **demo_settings(mode))
    history = {"reward": [], "length": [], "grad_norm": [], "agg_share": []}
    invariance = None
    for step in range(args.steps):
        t_step = time.perf_counter()
        batch = rollout(policy, args.prompts_per_step, n, generator)
        if invariance is None and step >= args.steps // 2:
            invariance = invariance_check(policy, config, batch, args.clip)
        plan = StepPlan(config, batch["lengths"], group_index=batch["group_index"], session_index=batch["session_index"])
        opt.zero_grad()
        _, agg_seconds = pg_step_loss(policy, batch, plan, args.micro_batches, args.clip)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1e9))
        opt.step()
        history["reward"].append(float(batch["reward"].mean()))
        history["length"].append(float(batch["lengths"].float().mean()))
        history["grad_norm"].append(grad_norm)
        history["agg_share"].append(agg_seconds / (time.perf_counter() - t_step))
        progress(mode, step + 1, history["reward"][-1])
    if invariance is None:
        # Every advantage was 0 on every checked step (a collapsed policy): check the
        # split on the last batch with synthetic advantages instead.
        batch["adv"] = torch.randn(batch["adv"].shape, generator=generator)
        invariance = invariance_check(policy, config, batch, args.clip)
    return history, invariance
