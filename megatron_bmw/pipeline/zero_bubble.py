"""Zero-bubble schedules with more memory than ZB-H1: ZB-H2 (one chunk per rank) and ZB-V (two chunks in a V).

Qi et al. (ICLR 2024) split each backward into its input gradient B and its weight gradient W; W feeds no other
rank, so it can fill any idle slot.

ZB-H2 comes from a greedy walk in unit time (F, B and W one unit each, transfers free): at every step each free
rank runs
  1. the oldest B whose gradient has arrived (the critical path: every earlier stage waits for it),
  2. else the oldest F whose input has arrived, if the rank's activation budget allows it (chunks deeper in
     the model first: they bring the micro-batch closer to its loss),
  3. else its oldest pending W,
and idles only when none of them can run. The budget caps the chunk-micro-batches a rank holds (a FORWARD's
until its W ends, pipeline/holding.py's rule); a micro-batch's first F on a rank reserves room for its later
chunks' F there, so those never wait for memory and the walk cannot stall. ZB-H2's budget is 2p - 1
micro-batches on every rank: the extra warm-up forwards fill the bubble before the first B and the W's the
tail; with equal F, B and W times every rank then computes without a gap from its first action to its last.

ZB-V places virtual stage s of 2p on rank s for s < p and on rank 2p-1-s otherwise (placement "v"), so a
micro-batch goes down the ranks in chunk 0 and back up in chunk 1 and rank 0 holds the embedding and the
loss. Its order is fixed by phases (`zbv_order`), as in the paper's figure: chunk-0 forwards until the first
chunk-1 input can have arrived, then chunk-1/chunk-0 forward pairs, then chunk-1 F B W until chunk 0's
first gradient, a steady F B W over both chunks, and a cool-down whose deferred W's fill the tail. A rank holds
at most 2p chunk-micro-batches (1F1B's p micro-batches of a whole stage), and the steady phase keeps W next to
its B, so the order stays good when B and W take other times than F.

Both give each rank's order only; the engine and the replay run that order under any durations (each rank
waits only for data, so an order that completes under one timing completes under every timing).
"""

from __future__ import annotations

from .schedule import Action, Kind, Schedule, ScheduleError, stage_index


def zbv_order(p: int, m: int) -> Schedule:
    """ZB-V's per-rank F/B/W order (placement "v", two chunks); phases clipped to what exists for small m."""
    actions = []
    for r in range(p):
        out: list[Action] = []
        done = {Kind.FORWARD: [0, 0], Kind.BACKWARD_INPUT: [0, 0], Kind.BACKWARD_WEIGHT: [0, 0]}

        def run(kind: Kind, chunk: int) -> None:
            n = done[kind]
            if kind is Kind.FORWARD:
                possible = n[chunk] < m and (chunk == 0 or n[1] < n[0])
            else:
                before = done[Kind.FORWARD if kind is Kind.BACKWARD_INPUT else Kind.BACKWARD_INPUT]
                possible = n[chunk] < before[chunk]
            if possible:
                out.append(Action(kind, n[chunk], chunk))
                n[chunk] += 1

        f, b, w = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
        for _ in range(2 * (p - r) - 1):  # until chunk 1's first input can be here
            run(f, 0)
        for _ in range(r):  # until chunk 1's first gradient can be here
            run(f, 1)
            run(f, 0)
        for _ in range(p - r):  # until chunk 0's first gradient can be here
            for kind in (f, b, w):
                run(kind, 1)
        while done[f][1] < m:  # steady
            for chunk in (0, 1):
                for kind in (f, b, w):
                    run(kind, chunk)
        for _ in range(r):  # cool-down: the W's wait for the idle tail
            run(b, 0)
            run(b, 1)
        for _ in range(p - r):
            run(b, 0)
            run(w, 0)
        while done[b][0] < m or done[b][1] < m:
            run(b, 1)
            run(b, 0)
        for chunk in (0, 1):
            while done[w][chunk] < m:
                run(w, chunk)
        actions.append(out)
    return Schedule("zbv", p, m, 2, actions, placement="v")


def zb_h1_order(p: int, m: int) -> Schedule:
    """ZB-H1's per-rank order (generators.zb_h1 says why)."""
    fwd = [Action(Kind.FORWARD, i) for i in range(m)]
    bin_ = [Action(Kind.BACKWARD_INPUT, i) for i in range(m)]
    wgt = [Action(Kind.BACKWARD_WEIGHT, i) for i in range(m)]
    actions = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        delay = rank
        acts = fwd[:warmup]
        w_next = 0
        for i in range(m):
            if i < m - warmup:
                acts.append(fwd[warmup + i])
            acts.append(bin_[i])
            if i - w_next >= delay or i >= m - warmup:  # steady state: W lags B by `delay`; cool-down: B, W
                acts.append(wgt[w_next])
                w_next += 1
        acts += wgt[w_next:]
        actions.append(acts)
    return Schedule("zb-h1", p, m, 1, actions)


def zb_h2_budgets(p: int) -> list[float]:
    """Per rank, the micro-batches ZB-H2 may hold: 2p - 1."""
    return [2.0 * p - 1] * p


def list_schedule(name: str, p: int, m: int, v: int, placement: str, budgets: list[float]) -> Schedule:
    """Each rank's F/B/W order from the greedy walk (see the module docstring)."""
    n_stages = p * v
    last = n_stages - 1
    # time (step) at which an input becomes available: act_at[s][mb] for stage s's activation input,
    # grad_at[s][mb] for its gradient input; None until produced
    act_at = [[0 if s == 0 else None for _ in range(m)] for s in range(n_stages)]
    grad_at: list[list[int | None]] = [[None] * m for _ in range(n_stages)]
    next_f = [[0] * v for _ in range(p)]
    next_b = [[0] * v for _ in range(p)]
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, chunk) whose W is pending
    held = [0.0] * p
    reserved = [0.0] * p  # later chunks' forwards of micro-batches already started on the rank
    stages = [[stage_index(r, c, p, placement) for c in range(v)] for r in range(p)]
    first_chunk = [min(range(v), key=lambda c: stages[r][c]) for r in range(p)]
    order: list[list[Action]] = [[] for _ in range(p)]
    remaining = 3 * m * v * p
    t = 0
    while remaining:
        produced = []  # (is_grad, stage, mb) available from t + 1
        ran = False
        for r in range(p):
            a = _pick(r, t, m, v, stages[r], first_chunk[r], act_at, grad_at, next_f, next_b, waiting_w,
                      held, reserved, budgets[r])
            if a is None:
                continue
            order[r].append(a)
            ran = True
            remaining -= 1
            s = stages[r][a.chunk]
            if a.kind is Kind.FORWARD:
                next_f[r][a.chunk] += 1
                held[r] += 1
                if a.chunk == first_chunk[r]:
                    reserved[r] += v - 1
                else:
                    reserved[r] -= 1
                produced.append((s == last, s + 1 if s < last else s, a.microbatch))
            elif a.kind is Kind.BACKWARD_INPUT:
                next_b[r][a.chunk] += 1
                waiting_w[r].append((a.microbatch, a.chunk))
                if s > 0:
                    produced.append((True, s - 1, a.microbatch))
            else:
                held[r] -= 1
        if not ran:  # nothing ran, so nothing new arrives: no step can ever run again
            raise ScheduleError(f"{name}: the list scheduler stalled at step {t} (p={p}, m={m}, v={v})")
        for grad, s, mb in produced:
            (grad_at if grad else act_at)[s][mb] = t + 1
        t += 1
    return Schedule(name, p, m, v, order, placement=placement)


def _pick(r, t, m, v, stages, first, act_at, grad_at, next_f, next_b, waiting_w, held, reserved,
          budget) -> Action | None:
    for what in "BFW":
        if what == "B":
            best = None
            for c in range(v):  # oldest input gradient first; equal micro-batches: the deeper chunk
                mb = next_b[r][c]
                if mb < m and mb < next_f[r][c]:
                    at = grad_at[stages[c]][mb]
                    if at is not None and at <= t and (best is None or (mb, -stages[c]) < best[0]):
                        best = ((mb, -stages[c]), c, mb)
            if best is not None:
                return Action(Kind.BACKWARD_INPUT, best[2], best[1])
        elif what == "F":
            for c in sorted(range(v), key=lambda c: -stages[c]):  # deeper chunks first
                mb = next_f[r][c]
                if mb >= m:
                    continue
                at = act_at[stages[c]][mb]
                if at is None or at > t:
                    continue
                if c == first and held[r] + reserved[r] + v > budget + 1e-9:
                    continue
                return Action(Kind.FORWARD, mb, c)
        elif waiting_w[r]:
            mb, c = waiting_w[r].pop(0)
            return Action(Kind.BACKWARD_WEIGHT, mb, c)
    return None
