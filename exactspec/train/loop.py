"""Training a drafter against the frozen target's distributions (distillation), with checkpoints and resume.

Every loss is a cross-entropy to the target's soft labels over the draft vocabulary: at a position t the target's
distribution of the next token is ``softmax(features[t] @ lm_head.T)`` (normalised by the stored log-sum-exp), and
the drafter's prediction for that token is pulled towards it. The loss counts the answer positions (the target's
own output, which is what drafting must predict); the prompts serve as context.

The held-out estimate is the greedy agreement on the held-out answers: how often the drafter's first choice is the
target's greedy token, for each draft position a method can measure without running the target (draft-model: the
first; eagle: the first, and the second after its own predicted feature; mtp: one per head; early-exit: the
first, which is each draft position's too, since its draft reads the target's own shallow layers). At temperature
0 that is the acceptance rate of that draft position, given the ones before were accepted.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from exactspec.drafters.networks import DraftLM, EagleHead, ExitAdapter, MTPHeads

CHECKPOINT_WEIGHTS = "checkpoint.safetensors"
CHECKPOINT_STATE = "checkpoint.json"
PROGRESS_SECONDS = 30


@dataclass
class TrainSettings:
    epochs: float = 2.0
    batch_tokens: int = 4096  # positions per batch (sequences padded to the longest in the batch)
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    feature_weight: float = 0.2  # eagle: weight of the feature regression beside the cross-entropy
    heldout_sequences: int = 48
    eval_every: int = 100  # steps
    checkpoint_minutes: float = 10.0
    seed: int = 0


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long
    features: torch.Tensor  # [B, T, hidden] float32
    lse: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool: t <= L-2 (the target's distribution at t is known: a token follows)
    answer: torch.Tensor  # [B, T] bool: the token after t is the target's answer (so t <= L-2, as valid)
    exit_states: torch.Tensor | None = None  # [B, T, hidden] float32: early-exit's inputs


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] long
    features: torch.Tensor  # [L, hidden] float16 (the last row is zero: never fed)
    lse: torch.Tensor  # [L]
    prompt_length: int
    exit_states: torch.Tensor | None = None  # [L, hidden] float16: the target's state after its exit layer


def sequences_of(shards: list[dict[str, torch.Tensor]], max_index: int | None = None) -> list[Sequence]:
    """The shards' sequences in prompt order; only prompts below ``max_index`` when given."""
    found = []
    for shard in shards:
        offsets = shard["offsets"].tolist()
        for i, (start, end) in enumerate(zip(offsets, offsets[1:])):
            index = int(shard["index"][i])
            if max_index is None or index < max_index:
                found.append((index, Sequence(shard["tokens"][start:end].long(), shard["features"][start:end],
                                              shard["lse"][start:end], int(shard["prompt_lengths"][i]))))
    return [sequence for _, sequence in sorted(found, key=lambda pair: pair[0])]


def collate(sequences: list[Sequence]) -> Batch:
    width = max(len(s.tokens) for s in sequences)
    b, hidden = len(sequences), sequences[0].features.shape[1]
    tokens = torch.zeros(b, width, dtype=torch.long)
    features = torch.zeros(b, width, hidden)
    lse = torch.zeros(b, width)
    valid = torch.zeros(b, width, dtype=torch.bool)
    answer = torch.zeros(b, width, dtype=torch.bool)
    for i, s in enumerate(sequences):
        n = len(s.tokens)
        tokens[i, :n] = s.tokens
        features[i, :n] = s.features.float()
        lse[i, :n] = s.lse
        valid[i, : n - 1] = True
        answer[i, s.prompt_length - 1 : n - 1] = True
    return Batch(tokens, features, lse, valid, answer, _padded([s.exit_states for s in sequences], width))


def _padded(rows: list[torch.Tensor | None], width: int) -> torch.Tensor | None:  # each [L, hidden] -> [B, T, hidden]
    if any(row is None for row in rows):
        return None
    padded = torch.zeros(len(rows), width, rows[0].shape[1])
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row.float()
    return padded


def batches(sequences: list[Sequence], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Sequence indexes per batch: shuffled, then grouped among neighbours of similar length so that padding is
    small, at most ``batch_tokens`` padded positions each."""
    order = list(range(len(sequences)))
    rng.shuffle(order)
    groups: list[list[int]] = []
    for chunk_start in range(0, len(order), 256):
        chunk = sorted(order[chunk_start : chunk_start + 256], key=lambda i: len(sequences[i].tokens))
        current: list[int] = []
        for i in chunk:
            width = max([len(sequences[j].tokens) for j in current] + [len(sequences[i].tokens)])
            if current and width * (len(current) + 1) > batch_tokens:
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
    rng.shuffle(groups)
    return groups


def distill_loss(vocab, predicted: torch.Tensor, truth: torch.Tensor, truth_lse: torch.Tensor) -> torch.Tensor:
    """Mean over positions of -sum_v p(v) log q(v) over the draft vocabulary: q from the drafter's predicted
    hidden states [N, hidden], p the target's distribution from its features [N, hidden] and log-sum-exp [N]."""
    with torch.no_grad():
        target = (vocab.logits(truth) - truth_lse[:, None]).exp()  # [N, V']; sums to the vocabulary's coverage
    return -(target * F.log_softmax(vocab.logits(predicted), dim=-1)).sum(-1).mean()


def agreement(logits: torch.Tensor, vocab, next_tokens: torch.Tensor) -> tuple[int, int]:
    """(hits, positions): how often the drafter's first choice (logits [N, V']) is the target's token [N]."""
    return int((vocab.ids[logits.argmax(-1)] == next_tokens).sum()), len(next_tokens)


def trained_positions(batch: Batch, offset: int) -> torch.Tensor:  # [B, T-offset] bool
    """Positions t whose prediction of the token ``offset`` places on is trained and measured: the target's
    answer, where its distribution at t + offset is known."""
    return batch.answer[:, offset:]


class Objective:
    """A method's loss on a batch, and its held-out greedy agreement (hits, positions) per draft position."""

    def __init__(self, settings: TrainSettings) -> None:
        self.settings = settings


class DraftModelObjective(Objective):
    """The draft LM at t predicts the token after t."""

    def loss(self, net: DraftLM, batch: Batch) -> torch.Tensor:
        hidden = net(batch.tokens)  # [B, T, hidden]
        mask = trained_positions(batch, 0)
        return distill_loss(net.vocab, hidden[mask], batch.features[mask], batch.lse[mask])

    @torch.no_grad()
    def agreement(self, net: DraftLM, batch: Batch) -> list[tuple[int, int]]:
        mask = trained_positions(batch, 0)[:, :-1]
        hidden = net(batch.tokens)[:, :-1]
        return [agreement(net.vocab.logits(hidden[mask]), net.vocab, batch.tokens[:, 1:][mask])]


class EagleObjective(Objective):
    """The head at t reads (feature t, token t+1) and predicts feature t+1, which the LM head reads for token t+2.
    A second pass feeds the head its own predicted features (as drafting does past the first token)."""

    def _passes(self, net: EagleHead, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T-1, hidden] each
        inputs, next_tokens = batch.features[:, :-1], batch.tokens[:, 1:]
        first = net(inputs, next_tokens)  # predicted features 1..T-1
        fed_back = torch.cat([inputs[:, :1], first[:, :-1].detach()], dim=1)  # its own prediction of feature t
        return first, net(fed_back, next_tokens)

    def loss(self, net: EagleHead, batch: Batch) -> torch.Tensor:
        first, second = self._passes(net, batch)
        mask = trained_positions(batch, 1)  # [B, T-1]
        truth, truth_lse = batch.features[:, 1:][mask], batch.lse[:, 1:][mask]
        total = torch.zeros(())
        for predicted in (first[mask], second[mask]):
            total = total + distill_loss(net.vocab, predicted, truth, truth_lse) + \
                self.settings.feature_weight * F.smooth_l1_loss(predicted, truth)
        return total / 2

    @torch.no_grad()
    def agreement(self, net: EagleHead, batch: Batch) -> list[tuple[int, int]]:
        first, second = self._passes(net, batch)
        mask = trained_positions(batch, 1)[:, :-1]  # position t predicts token t+2
        return [agreement(net.vocab.logits(p[:, :-1][mask]), net.vocab, batch.tokens[:, 2:][mask])
                for p in (first, second)]


class MTPObjective(Objective):
    """Head j (1-based) at t predicts the token j+1 positions after t (the target itself gives the one after t,
    which token-reading heads see)."""

    @staticmethod
    def _states(net: MTPHeads, batch: Batch) -> torch.Tensor:  # [heads, B, T-1, hidden]: t < T-1
        return net.head_states(batch.features[:, :-1], batch.tokens[:, 1:])

    def loss(self, net: MTPHeads, batch: Batch) -> torch.Tensor:
        states = self._states(net, batch)
        total = torch.zeros(())
        length = batch.tokens.shape[1]
        for j in range(1, states.shape[0] + 1):
            mask = trained_positions(batch, j)  # [B, T-j]
            total = total + distill_loss(net.vocab, states[j - 1][:, : length - j][mask],
                                         batch.features[:, j:][mask], batch.lse[:, j:][mask])
        return total / states.shape[0]

    @torch.no_grad()
    def agreement(self, net: MTPHeads, batch: Batch) -> list[tuple[int, int]]:
        states = self._states(net, batch)
        length = batch.tokens.shape[1]
        rates = []
        for j in range(1, states.shape[0] + 1):
            mask = trained_positions(batch, j)[:, :-1]  # [B, T-j-1]
            rates.append(agreement(net.vocab.logits(states[j - 1][:, : length - j - 1][mask]), net.vocab,
                                   batch.tokens[:, j + 1 :][mask]))
        return rates


class EarlyExitObjective(Objective):
    """The adapter at t reads the target's state after its exit layer and predicts the token after t."""

    def loss(self, net: ExitAdapter, batch: Batch) -> torch.Tensor:
        mask = trained_positions(batch, 0)
        return distill_loss(net.vocab, net(batch.exit_states[mask]), batch.features[mask], batch.lse[mask])

    @torch.no_grad()
    def agreement(self, net: ExitAdapter, batch: Batch) -> list[tuple[int, int]]:
        mask = trained_positions(batch, 0)[:, :-1]
        states = batch.exit_states[:, :-1][mask]
        return [agreement(net.vocab.logits(net(states)), net.vocab, batch.tokens[:, 1:][mask])]


OBJECTIVES = {"draft-model": DraftModelObjective, "eagle": EagleObjective, "mtp": MTPObjective,
              "early-exit": EarlyExitObjective}


def bigram_agreement(training: list[Sequence], heldout: list[Sequence], depth: int = 2) -> list[float]:
    """The baseline a trained drafter must beat: a table of each token's most frequent successor in the training
    answers, drafting greedily from the last context token. Per draft position up to ``depth``, how often its
    choice is the target's token on the held-out answers, given the draft before it was right (as the held-out
    agreement of the drafters is measured)."""
    from collections import Counter, defaultdict

    successors: dict[int, Counter] = defaultdict(Counter)
    for sequence in training:
        answer = sequence.tokens[max(sequence.prompt_length - 1, 0):].tolist()
        for a, b in zip(answer, answer[1:]):
            successors[a][b] += 1
    best = {token: counts.most_common(1)[0][0] for token, counts in successors.items()}
    hits, counts = [0] * depth, [0] * depth
    for sequence in heldout:
        tokens = sequence.tokens.tolist()
        for t in range(sequence.prompt_length - 1, len(tokens) - 1):
            guess = tokens[t]
            for d in range(depth):
                if t + d + 1 >= len(tokens):
                    break
                guess = best.get(guess, -1)
                counts[d] += 1
                if guess != tokens[t + d + 1]:
                    break
                hits[d] += 1
    return [h / c if c else 0.0 for h, c in zip(hits, counts)]


@dataclass
class Progress:
    """Where a run is, saved with each checkpoint: enough to resume it exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0  # training positions seen
    cpu_seconds: float = 0.0  # process CPU time (all threads)
    wall_seconds: float = 0.0
    curve: list[dict] = field(default_factory=list)  # held-out agreement at each evaluation


def heldout_agreement(objective, net, heldout: list[Sequence]) -> list[float]:
    net.eval()
    totals: list[list[int]] = []
    for start in range(0, len(heldout), 8):
        for depth, (hits, count) in enumerate(objective.agreement(net, collate(heldout[start : start + 8]))):
            if depth == len(totals):
                totals.append([0, 0])
            totals[depth][0] += hits
            totals[depth][1] += count
    net.train()
    return [hits / count if count else 0.0 for hits, count in totals]


def train(net: torch.nn.Module, method: str, sequences: list[Sequence], settings: TrainSettings, out: Path,
          resume: bool) -> Progress:
    """Train ``net`` in place on ``sequences`` (the last ``heldout_sequences`` held out); checkpoints in ``out``."""
    objective = OBJECTIVES[method](settings)
    heldout = sequences[-settings.heldout_sequences :]
    training = sequences[: -settings.heldout_sequences]
    torch.manual_seed(settings.seed)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=settings.lr,
                                  betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    per_epoch = len(batches(training, settings.batch_tokens, random.Random(settings.seed)))
    total_steps = max(1, int(per_epoch * settings.epochs))
    progress = Progress()
    if resume:
        progress = load_checkpoint(out, net, optimizer)
        print(f"exactspec: resuming at step {progress.step:,} of {total_steps:,}", file=sys.stderr)
    net.train()
    started_wall, started_cpu = time.perf_counter() - progress.wall_seconds, time.process_time() - progress.cpu_seconds
    last_report = last_checkpoint = time.perf_counter()
    recent_loss: list[float] = []
    if not progress.curve:
        _evaluate(objective, net, heldout, progress)
    while progress.step < total_steps:
        order = batches(training, settings.batch_tokens, random.Random(settings.seed * 1000 + progress.epoch))
        for group in order[progress.batch_in_epoch :]:
            if progress.step >= total_steps:
                break
            batch = collate([training[i] for i in group])
            for param_group in optimizer.param_groups:
                param_group["lr"] = _learning_rate(settings, progress.step, total_steps)
            loss = objective.loss(net, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), settings.clip)
            optimizer.step()
            recent_loss = (recent_loss + [loss.item()])[-50:]
            progress.step += 1
            progress.batch_in_epoch += 1
            progress.tokens += int(batch.valid.sum())
            progress.wall_seconds = time.perf_counter() - started_wall
            progress.cpu_seconds = time.process_time() - started_cpu
            if progress.step % settings.eval_every == 0 or progress.step == total_steps:
                _evaluate(objective, net, heldout, progress, sum(recent_loss) / len(recent_loss))
            now = time.perf_counter()
            if now - last_report > PROGRESS_SECONDS or progress.step == total_steps:
                _report(progress, total_steps, sum(recent_loss) / len(recent_loss))
                last_report = now
            if now - last_checkpoint > settings.checkpoint_minutes * 60:
                save_checkpoint(out, net, optimizer, progress)
                last_checkpoint = now
        else:
            progress.epoch += 1
            progress.batch_in_epoch = 0
    save_checkpoint(out, net, optimizer, progress)
    net.eval()
    return progress


def _learning_rate(settings: TrainSettings, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    done = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def _evaluate(objective, net, heldout: list[Sequence], progress: Progress, loss: float | None = None) -> None:
    rates = heldout_agreement(objective, net, heldout)
    progress.curve.append({"step": progress.step, "tokens": progress.tokens,
                           "cpu_hours": round(progress.cpu_seconds / 3600, 4), "loss": loss,
                           "heldout_agreement": [round(r, 4) for r in rates]})
    print(f"exactspec: held-out greedy agreement by draft position at step {progress.step:,} "
          f"({progress.tokens:,} tokens): {' '.join(f'{r:.3f}' for r in rates)}", file=sys.stderr, flush=True)


def _report(progress: Progress, total_steps: int, loss: float) -> None:
    elapsed = progress.wall_seconds
    eta = elapsed / max(progress.step, 1) * (total_steps - progress.step)
    width = 30
    filled = int(width * progress.step / total_steps)
    print(f"exactspec: [{'#' * filled}{'.' * (width - filled)}] step {progress.step:,}/{total_steps:,} "
          f"loss {loss:.3f} | {progress.tokens / max(elapsed, 1e-9):,.0f} tokens/s | "
          f"elapsed {_duration(elapsed)} | ETA {_duration(eta)}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def save_checkpoint(out: Path, net: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress) -> None:
    """Weights, optimizer moments and progress, as safetensors and JSON (written aside, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"net.{name}": t.detach().contiguous() for name, t in net.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"optimizer.{index}.{key}"] = torch.as_tensor(value).contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(out / (CHECKPOINT_WEIGHTS + ".partial")))
    (out / (CHECKPOINT_WEIGHTS + ".partial")).rename(out / CHECKPOINT_WEIGHTS)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    state = {"progress": asdict(progress), "param_groups": groups}
    (out / (CHECKPOINT_STATE + ".partial")).write_text(json.dumps(state, indent=1) + "\n")
    (out / (CHECKPOINT_STATE + ".partial")).rename(out / CHECKPOINT_STATE)


def load_checkpoint(out: Path, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Progress:
    from exactspec.errors import UsageError

    if not (out / CHECKPOINT_WEIGHTS).is_file() or not (out / CHECKPOINT_STATE).is_file():
        raise UsageError(f"--resume: no checkpoint in {out}")
    tensors = load_file(str(out / CHECKPOINT_WEIGHTS))
    state = json.loads((out / CHECKPOINT_STATE).read_text())
    net.load_state_dict({name[4:]: t for name, t in tensors.items() if name.startswith("net.")})
    moments: dict[int, dict] = {}
    for name, t in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            moments.setdefault(int(index), {})[key] = t
    template = optimizer.state_dict()
    groups = [{**saved, "params": group["params"]} for saved, group in zip(state["param_groups"],
                                                                           template["param_groups"])]
    optimizer.load_state_dict({"state": moments, "param_groups": groups})
    torch.set_rng_state(tensors["rng.torch"])
    return Progress(**state["progress"])
