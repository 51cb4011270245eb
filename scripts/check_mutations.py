"""Break the decoder on purpose, one mutation at a time, and check that the default test suite notices.

Each mutation is a textual edit of one package file, applied in place, followed by a pytest run of the suite's
exactness files (all of them part of the default run); the file is restored afterwards whatever happens. A
mutation that leaves every test passing is reported as SURVIVED and the command exits 1.

    .venv/bin/python scripts/check_mutations.py            # all mutations (~1 min each on 2 cores)
    .venv/bin/python scripts/check_mutations.py --only 1 3
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/decoding/test_decoder_reference.py", "tests/decoding/test_spot_exactness.py", "tests/adapters/test_adapter_contract.py",
         "tests/decoding/test_control_decoder.py", "tests/decoding/test_lookahead.py", "tests/drafter/test_host_drafter.py",
         "tests/decoding/test_auto_budget.py", "tests/adapters/test_fused_attention.py", "tests/adapters/test_round_syncs.py",
         "tests/likelihood/test_likelihood.py", "tests/decoding/test_batch.py", "tests/decoding/test_sampling.py",
         "tests/drafter/test_online.py", "tests/families/test_batch_families.py", "tests/drafter/test_drafter.py"]

MUTATIONS: list[tuple[str, str, str, str]] = [
    ("verifier accepts a drafted edge on its position alone", "lm_eval_spot/decoding/tree.py",
     "if tree.pos[c - 1] == tp[node] and tree.tok[c - 1] == tt[node]", "if tree.pos[c - 1] == tp[node]"),
    ("confidence is the max logit, not the max softmax", "lm_eval_spot/decoding/transition.py",
     "parts = [torch.softmax(flat[i : i + step].float(), dim=-1).amax(dim=-1)",
     "parts = [flat[i : i + step].float().amax(dim=-1)"),
    ("ties go to the highest index", "lm_eval_spot/decoding/transition.py",
     "return conf.argmax(dim=-1)", "return conf.shape[-1] - 1 - conf.flip(-1).argmax(dim=-1)"),
    ('noise redrawn every round', 'lm_eval_spot/decoding/loop.py',
     '        self.clock.start()\n',
     '        if self.blocks.gumbel is not None:\n            from lm_eval_spot.decoding.noise import gumbel_rows\n            self.blocks.gumbel = gumbel_rows(self.blocks.seed + self.rounds, self.blocks.block, self.info.block_len,\n                                             self.info.vocab_size, self.blocks.dev)\n        self.clock.start()\n'),
    ("a replica sees another replica's state", "lm_eval_spot/adapters/prefix_attention.py",
     "out, lse = kernel(qg.reshape(R, kvh, g * N, d), k, v, scaling, mask)",
     "out, lse = kernel(qg.reshape(R, kvh, g * N, d), k.roll(1, 0), v.roll(1, 0), scaling, mask)"),
    ("stale conditionals from the root instead of the deepest accepted node", "lm_eval_spot/decoding/loop.py",
     "stale_src = logits[last]", "stale_src = logits[0]"),
    ("lookahead row does not read the completion's keys", "lm_eval_spot/adapters/prefix_attention.py",
     "            extra.append((R - 1, R, N - L, k[a : a + 1, :, -L:], v[a : a + 1, :, -L:]))", "            pass"),
    ("next block's stale taken from the completion row, not the lookahead row", 'lm_eval_spot/decoding/loop.py',
     '        self.look.settle(self.blocks, ahead)\n',
     '        self.look.settle(self.blocks, logits[min(self.look.row, logits.shape[0] - 1)] if self.look.row is not None else ahead)\n'),
    ('lookahead logits keep the mask token as a candidate', 'lm_eval_spot/decoding/lookahead.py',
     '                ahead[..., blocks.info.mask_id] = float("-inf")',
     '                pass  #'),
    ("leading edge at the wrong slot", "lm_eval_spot/decoding/drafting.py",
     "    return pos, int(tok[pos])", "    return (pos + 1) % eligible.shape[0], int(tok[pos])"),
    ("leading edge with the runner-up token", "lm_eval_spot/decoding/drafting.py",
     "else stale.top_ids[:, 0]\n    return pos", "else stale.top_ids[:, 1]\n    return pos"),
    ("the round's eligibility goes up in a copy of its own", "lm_eval_spot/decoding/block.py",
     "        if dstates is not None and dstates.shape[0] >= states.shape[0]:", "        if False:"),
    ("the stale summary comes down one tensor at a time", "lm_eval_spot/transfer.py",
     "        if len(tensors) == 1:\n            return (tensors[0].cpu(),)",
     "        if len(tensors) > 0:\n            return tuple(t.cpu() for t in tensors)"),
    ("a stop id wins over an earlier stop string passed in the same round", "lm_eval_spot/decoding/stops.py",
     "keep = self.stop_check(head) if self.stop_check is not None and head else None",
     "keep = None if cut is not None else (self.stop_check(head) if self.stop_check is not None and head else None)"),
    ("best-first ties broken against creation order", "lm_eval_spot/drafter/best_first.py",
     "c.order.append((rank, k))", "c.order.append((rank, -k))"),
    ("best-first child forgets its own commit's pair row", "lm_eval_spot/drafter/factored.py",
     "return pair + self.pair_t[slot], open_[open_ != slot], slot", "return pair, open_[open_ != slot], slot"),
    ("numpy pass drops a norm's scale when folding it", "lm_eval_spot/drafter/host.py",
     "m = norm.weight.detach().double()[:, None] * w.T", "m = w.T"),
    ("best-first child scan stops at the best child found, not the budget-th", "lm_eval_spot/drafter/best_first.py",
     "            kth = -found[-1][0]", "            kth = -found[0][0]"),
    ("budget=auto prices a drafted row at its average share of the step's forward, not its marginal cost",
     "lm_eval_spot/decoding/step_policy.py",
     "fwd = np.vectorize(price, otypes=[float])(rows) if not isinstance(forward, RowCosts) else _table(forward, rows)",
     "fwd = price(base_rows) / base_rows * rows"),
    ("budget=auto reads every rank's acceptance as the optimistic prior (ignores the verifier's record)",
     "lm_eval_spot/decoding/step_policy.py", "        self._acc[k, r - 1] += 1.0", "        pass"),
    ("budget=auto's zero-row rounds still compute the stale summary (drafter work for a control round)",
     "lm_eval_spot/decoding/drafting.py", "and budget != 0\n", "\n"),
    ("budget=auto's per-step choice is ignored (every round drafts to the proposer's budget)",
     "lm_eval_spot/decoding/batch.py", "            req.begin_drafting(b)", "            req.begin_drafting(None)"),
    ("budget=auto never lets a request that stopped drafting try again (its own record never fades)",
     "lm_eval_spot/decoding/step_policy.py", "PACE_FORGET = 0.85", "PACE_FORGET = 1.0"),
    ("budget=auto skips the next 7 choices after a single choice that drafted nothing (no back-off)",
     "lm_eval_spot/decoding/step_policy.py", "min(2 ** (self._zeros - 1), IDLE_EVERY) - 1", "IDLE_EVERY - 1"),
    ("replica rows do not read the pending block's keys", "lm_eval_spot/adapters/prefix_attention.py",
     "self._cascade(ext, q[1:], k[1:], v[1:], scaling, extra)", "self._cascade(kv, q[1:], k[1:], v[1:], scaling, extra)"),
    ("a block's first round scores replica rows over the pending block as a separate piece",
     "lm_eval_spot/adapters/prefix_attention.py",
     "self._cascade(ext, q[1:], k[1:], v[1:], scaling, extra)",
     "self._cascade(kv, q[1:], k[1:], v[1:], scaling, extra + [(0, R - 1, 0, k[:1], v[:1])])"),
    ("rows do not read the stored prefix", "lm_eval_spot/adapters/prefix_attention.py",
     "        if pre is not None and pre[0].shape[-2]:\n            piece = merge(",
     "        if False:\n            piece = merge("),
    ("the prompt's pending blocks read the state after them", "lm_eval_spot/adapters/prefix_attention.py",
     "mask = None if self.dense else self.new_mask.repeat(g, 1)", "mask = None"),
    ("likelihood: sampled rows weighted 1/l, not k/l", "lm_eval_spot/likelihood/patterns.py",
     "return MaskPlan(masked, k / counts.double(), False)", "return MaskPlan(masked, 1.0 / counts.double(), False)"),
    ("likelihood: exact patterns not divided by their count", "lm_eval_spot/likelihood/patterns.py",
     "w = 1.0 / (l * math.comb(k, l))", "w = 1.0 / l"),
    ("likelihood: a noised row committed as the next block's prefix", "lm_eval_spot/likelihood/scorer.py",
     "session.commit_block(unit.targets[0])", "session.commit_block(unit.states[0])"),
    ("likelihood: Dream's shifted logits read unshifted", "lm_eval_spot/likelihood/scorer.py",
     'shifted = bool(getattr(getattr(adapter, "protocol", None), "shifted", False))', "shifted = False"),
    ("likelihood: a context's continuations draw independent masks", "lm_eval_spot/likelihood/harness.py",
     '        return mix_seed(base_seed, "ll", tuple(context))\n',
     '        return mix_seed(base_seed, "ll", tuple(context), tuple(continuation))\n'),
    ("likelihood: a fork continues from a noised first block", "lm_eval_spot/likelihood/scorer.py",
     "own.commit_block(u[0].targets[0])", "own.commit_block(u[0].states[0])"),
    ("likelihood: a group's shared rows read off by one pair", "lm_eval_spot/likelihood/scorer.py",
     "t.add(u[0].plan, all_sums[bounds[i] : bounds[i + 1]], forwards[i])",
     "t.add(u[0].plan, all_sums[bounds[i - 1] : bounds[i]] if i else all_sums[: bounds[1]], forwards[i])"),
    ("a request's rows verified against another request's logits in the shared forward",
     "lm_eval_spot/adapters/block_causal.py",
     "out[i] = p.session.finish(p, logits[a:b], ids_dev[a:b])",
     "out[i] = p.session.finish(p, (logits.roll(1, 0) if len(group) > 1 else logits)[a:b], ids_dev[a:b])"),
    ('the coupled verifier drops top_p (control keeps it)', 'lm_eval_spot/decoding/coupled.py',
     'pos_d, tok_d = transition(logits, eligible, self.temperature, at.gumbel, self.truncation)',
     "pos_d, tok_d = transition(logits, eligible, self.temperature, at.gumbel, self.truncation if tree.size == 0 else (self.truncation and __import__('dataclasses').replace(self.truncation, top_p=1.0)))"),
    ("the rejection verifier's target law drops top_p", "lm_eval_spot/decoding/rejection.py",
     "p = tempered_probs(logits[rows, pos_star], temperature, trunc)",
     "p = tempered_probs(logits[rows, pos_star], temperature, None if trunc is None else Truncation(trunc.top_k))"),
    ("budget=auto prices every drafter at the first drafter's host cost", 'lm_eval_spot/decoding/step_policy.py',
     '(track.draft.a, track.draft.b + self.rest.b), extra=extra,',
     '(self.draft.a, self.draft.b + self.rest.b), extra=extra,'),
    ("a round drafts with the first drafter whichever the policy chose", 'lm_eval_spot/decoding/drafting.py',
     'self.proposer = self.options[option]', 'self.proposer = self.options[0]'),
    ('online adaptation trains only once no request is mid-decode (the old chunk boundaries)', 'lm_eval_spot/harness/generation.py',
     'online.update()  # between steps',
     'None if recorders else online.update()  # between steps'),
    ("the round's observers also see a rejected draft's state as if the target had visited it", 'lm_eval_spot/decoding/loop.py',
     'self.observed.add_round(self.blocks.block, [0, *verdict.path],',
     'self.observed.add_round(self.blocks.block, [0, *verdict.path] + [c + 1 for c, p in enumerate(self._tree.parent) if p == ([0, *verdict.path])[-1]][:1],'),
    ("top-k drops the tokens tied with the k-th", "lm_eval_spot/decoding/sampling.py",
     'out = out.masked_fill(out < kth, float("-inf"))', 'out = out.masked_fill(out <= kth, float("-inf")).maximum('
     'out.amax(dim=-1, keepdim=True).where(out == out.amax(dim=-1, keepdim=True), torch.tensor(float("-inf"), '
     'dtype=out.dtype)))'),
    ("top-p keeps the token that crosses the threshold out", "lm_eval_spot/decoding/sampling.py",
     "drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p",
     "drop = ordered.softmax(dim=-1).cumsum(dim=-1) < 1.0 - top_p + 1e-3"),
    ("bidirectional batch: a request's rows verified against another request's logits", "lm_eval_spot/adapters/bidirectional.py",
     "                out[i] = logits[a : a + r]\n", "                out[i] = logits.roll(r, 0)[a : a + r]\n"),
    ("bidirectional batch (cache=approx): a request's cached rows read off another's", "lm_eval_spot/adapters/bidirectional.py",
     "                rest_out.append(logits[a : a + len(rest[i])])",
     "                rest_out.append(logits.roll(len(rest[i]), 0)[a : a + len(rest[i])])"),
    ("ragged forward: a shorter canvas's attention sees its padding", "lm_eval_spot/adapters/ragged.py",
     "out[a:b, :n] = inner.attend(layer, q[a:b, :, :n], k[a:b, :, :n], v[a:b, :, :n], scaling)",
     "out[a:b] = inner.attend(layer, q[a:b], k[a:b], v[a:b], scaling)"),
    ("remote batch: a request stores its batch-mate's pending keys", "lm_eval_spot/adapters/remote_block_causal.py",
     "s._kv = cache_kv(cache, cached + P, row=a)", "s._kv = cache_kv(cache, cached + P, row=0)"),
    ("the oracle drafts before its request's control decode ran", "lm_eval_spot/harness/generation.py",
     "if control_first or source.reads_control else", "if control_first else"),
]


def run(index: int) -> bool:
    """True if the suite caught mutation `index` (some test failed)."""
    name, rel, old, new = MUTATIONS[index]
    path = ROOT / rel
    original = path.read_text()
    if original.count(old) != 1:
        raise SystemExit(f"mutation {index + 1} ({name}): the text to replace occurs {original.count(old)} times")
    try:
        path.write_text(original.replace(old, new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                              cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(original)
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
    caught = proc.returncode != 0
    print(f"{index + 1}. {name}: {'caught by ' + failed[0].split()[1] if caught and failed else 'caught' if caught else 'SURVIVED'}",
          flush=True)
    return caught


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=int, nargs="*", help="1-based mutation numbers")
    args = ap.parse_args()
    # A killed run must still restore the mutated file: SIGTERM becomes SystemExit, so `run`'s finally runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    picks = [i - 1 for i in args.only] if args.only else range(len(MUTATIONS))
    survived = [i + 1 for i in picks if not run(i)]
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
