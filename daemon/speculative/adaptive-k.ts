/**
 * How many tokens to draft per verification (K), as a pure function of measured quantities. With
 * a per-token acceptance rate α (each drafted token stands with probability α given the previous
 * ones stood), one round of K drafts yields E(K) = (1 − α^(K+1)) / (1 − α) tokens (the accepted
 * prefix plus the target's own next token) and costs
 *   T(K) = K·draft + verify(K) + hops·hop,   verify(K) = verifyBase + K·verifyPerToken.
 * K = argmax E(K)/T(K); K = 0 (plain decoding: one token per verifyBase + hops·hop) wins whenever
 * no K beats it. Beside other sequences decoding on the same engine (`batchPeers`), a plain step is
 * one row of a batched run that gives every one of them a token, while a verify round of several
 * positions runs alone and they wait: plain decoding then yields (1 + batchPeers) tokens per step
 * for the engine, and a round must beat that. Plain decoding's own cost per token (`plainTokenMs`)
 * is what its steps cost as they run between rounds, run-ahead included (plainTokenMs below), not
 * the cost of a step that surely ran (`verifyBaseMs`, what a verify round pays: it runs alone, nothing
 * computed ahead). Long round trips make each traversal dear, so the best K grows with the hop time
 * — the numbers the paper reports (5–7 on a LAN, ~10 at ≥ 50 ms per hop) come out of this, they
 * are not written in.
 */

export interface SpeculationCosts {
  /** Per-token acceptance rate in [0, 1]. */
  acceptance: number
  /** One draft step (one proposed token), ms. */
  draftStepMs: number
  /** A plain one-position step of the target (every stage) that surely ran, ms: a verify's base. */
  verifyBaseMs: number
  /**
   * Plain decoding's time per token as the source waits for it, ms: its steps between rounds,
   * those the engine computed ahead included (plainTokenMs). Absent: verifyBaseMs.
   */
  plainTokenMs?: number
  /** What each extra verified position adds to that step, ms. */
  verifyPerTokenMs: number
  /** Network time per hop of one traversal, ms (0 on one machine). */
  hopMs: number
  /** Hops per traversal (stages + the way back; 0 on one machine). */
  hops: number
  /** Other sequences decoding in the same engine's batches (0: alone, or a chain). */
  batchPeers?: number
}

/** Expected tokens from one round of K drafts at acceptance α. */
export function expectedTokens (acceptance: number, k: number): number {
  const a = Math.min(Math.max(acceptance, 0), 1)
  if (a >= 1) return k + 1
  return (1 - a ** (k + 1)) / (1 - a)
}

/** Expected tokens per millisecond with K drafts per round (K = 0: plain decoding, run-ahead included). */
export function tokensPerMs (c: SpeculationCosts, k: number): number {
  const t = k === 0
    ? (c.plainTokenMs ?? c.verifyBaseMs) + c.hops * c.hopMs
    : k * c.draftStepMs + c.verifyBaseMs + k * c.verifyPerTokenMs + c.hops * c.hopMs
  return t > 0 ? expectedTokens(c.acceptance, k) / t : Infinity
}

/**
 * Plain decoding's cost per token from the times the source waited for its recent plain steps
 * (ms, oldest first): their mean, the steps whose token the engine's worker computed ahead (and
 * that were ready sooner, or at once) included. Not the wall time between tokens: the decode
 * loop's own work between two calls (emitting, detokenizing) is paid per token by a round's
 * tokens too, and overlaps a run-ahead step's compute; a round is timed the same way, from its
 * call to its verdict. Counting only steps that surely ran made plain decoding look as slow as a
 * step without run-ahead, and adaptive K speculated where plain decoding was faster. Undefined
 * with no steps.
 */
export function plainTokenMs (stepsMs: readonly number[]): number | undefined {
  if (stepsMs.length === 0) return undefined
  let sum = 0
  for (const ms of stepsMs) sum += Math.max(0, ms)
  return sum / stepsMs.length
}

/** Plain steps plainTokenMs averages over (about two probe spacings at the default 16). */
export const PLAIN_WINDOW = 32

/**
 * The K in [0, maxK] with the highest expected tokens per second (smallest K on ties). Speculating
 * at all must promise `minGain` over plain decoding (default 5 %): costs are measured on a noisy
 * machine, and a drafter whose drafts almost never stand should not be kept busy for a rounding error.
 */
export function chooseK (c: SpeculationCosts, maxK: number, minGain = 0.05): number {
  let best = 0
  const plain = tokensPerMs(c, 0) * (1 + Math.max(0, c.batchPeers ?? 0))
  let bestRate = plain
  for (let k = 1; k <= maxK; k++) {
    const r = tokensPerMs(c, k)
    // A K must beat the smaller ones by a hair: measurement noise should not buy longer rounds.
    if (r > bestRate * 1.0001 && r > plain * (1 + minGain)) { best = k; bestRate = r }
  }
  return best
}

/**
 * Running estimates of the costs above for one request, decayed so they follow a generation whose
 * acceptance changes (it rises with length in the paper's runs). Acceptance counts each examined
 * draft token as a trial: a round with n of K accepted is n successes and, when n < K, one failure.
 */
export interface CostTracker {
  /** Records one verified round. */
  round (drafted: number, accepted: number, draftMs: number, verifyMs: number): void
  /**
   * Records a plain (K = 0) step: how long the source waited for its token. `ran` (default
   * true): it surely ran in that time, not taken from the run-ahead — only those measure a
   * verify's base. Plain steps count towards plain decoding's own cost (plainTokenMs), except with
   * `asPlain` false: a step the source ran without run-ahead only because a round was expected
   * next (source.ts), which plain decoding would not pay.
   */
  plain (stepMs: number, ran?: boolean, asPlain?: boolean): void
  /**
   * `missed`: the costs as if a round of `missed` drafts had just been recorded with none accepted
   * (nothing is recorded): what the next K would be chosen from should this round fail.
   */
  costs (hopMs: number, hops: number, batchPeers?: number, missed?: number): SpeculationCosts
  /** Rounds recorded so far. */
  readonly rounds: number
}

export interface CostPriors {
  acceptance?: number
  /** Decay per observation (default 0.9: about the last ten rounds matter). */
  decay?: number
}

export function createCostTracker (priors: CostPriors = {}): CostTracker {
  const decay = priors.decay ?? 0.9
  // Acceptance as decayed successes / trials, starting from one pseudo-trial at the prior.
  let hits = priors.acceptance ?? 0.7
  let trials = 1
  let draftPerToken: number | undefined
  let base: number | undefined
  let perToken: number | undefined
  /** The latest plain steps' times (at most PLAIN_WINDOW), oldest first. */
  const plainSteps: number[] = []
  let rounds = 0
  const ewma = (old: number | undefined, x: number): number => old === undefined ? x : decay * old + (1 - decay) * x
  return {
    get rounds () { return rounds },
    round (drafted, accepted, draftMs, verifyMs) {
      if (drafted <= 0) return
      rounds++
      hits = decay * hits + accepted
      trials = decay * trials + accepted + (accepted < drafted ? 1 : 0)
      draftPerToken = ewma(draftPerToken, draftMs / drafted)
      // Until a plain step was measured, a verify's cost is split as if every position cost alike.
      const b = base ?? verifyMs / (drafted + 1)
      perToken = ewma(perToken, Math.max(0, (verifyMs - b) / drafted))
    },
    plain (stepMs, ran = true, asPlain = true) {
      if (ran) base = ewma(base, stepMs)
      if (!asPlain) return
      plainSteps.push(stepMs)
      if (plainSteps.length > PLAIN_WINDOW) plainSteps.shift()
    },
    costs (hopMs, hops, batchPeers = 0, missed = 0) {
      const b = base ?? 1
      const h = missed > 0 ? decay * hits : hits
      const t = missed > 0 ? decay * trials + 1 : trials
      return {
        batchPeers,
        acceptance: t > 0 ? h / t : 0,
        draftStepMs: draftPerToken ?? 0,
        verifyBaseMs: b,
        ...(plainSteps.length === 0 ? {} : { plainTokenMs: plainTokenMs(plainSteps) }),
        verifyPerTokenMs: perToken ?? 0,
        hopMs,
        hops,
      }
    },
  }
}
