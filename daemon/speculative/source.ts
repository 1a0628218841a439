/**
 * The speculative token source: the decode loop (daemon/engine generateSequence) asks it for one
 * token at a time as for any source; behind that, each round drafts K tokens, verifies them with
 * one target step of K + 1 positions (logits of every position), keeps the accepted prefix plus
 * the target's own next token, rolls the target's KV back over the rejected positions by length,
 * and hands the tokens out one per call. The tokens are the target's own: greedy by id; with
 * temperature, speculative sampling keeps the target's distribution exactly.
 *
 * A drafter that fails is dropped for the rest of the sequence and decoding goes on plainly: a
 * draft can cost speed, never a token.
 *
 * Where acceptance happens is the verifier's business: on a whole model, for greedy requests in
 * the engine's worker (a verdict: the accepted count and the next token, the rejected positions
 * rolled back there), for sampled ones here from the verify step's logits (speculative sampling),
 * then a rollback; on a pipeline chain at its last stage, which sends back only the accepted count
 * and the next token.
 */
import { EngineError, nextPick, RUN_AHEAD_STEPS, runsAheadAfter } from '../engine/index.ts'
import type { Rng, SamplerParams, StepOptions, StepOutput, TokenPick, TokenSource } from '../engine/index.ts'
import { createRng } from '../engine/index.ts'
import type { SamplingParams } from '../service.ts'
import { acceptGreedy, acceptSampled, distribution } from './acceptance.ts'
import type { Acceptance } from './acceptance.ts'
import { chooseK, createCostTracker } from './adaptive-k.ts'
import type { CostTracker } from './adaptive-k.ts'
import type { Drafter, Proposal, SequenceDrafter } from './drafter.ts'

/** The target sequence's steps, however they run (directly on the engine or through the micro-batcher). */
export interface TargetSequence {
  /** `options.ahead`: a plain decode step's run-ahead picks (the engine may compute those steps before they are asked for). */
  step (kind: 'prefill' | 'decode', tokenIds: number[], positions: number[], options: StepOptions & { ahead?: TokenPick[] }, signal: AbortSignal): Promise<StepOutput>
  /** Sets the target's KV back to its first `length` positions. */
  rollback (length: number, signal: AbortSignal): Promise<void>
}

/** Checks a round's drafts against the target. */
export interface Verifier {
  /** `ahead`: the picks of the plain steps that may follow, for a target that can run them ahead (a verifier may ignore them). */
  prefill (promptIds: number[], pick: TokenPick, signal: AbortSignal, ahead?: TokenPick[]): Promise<number>
  /**
   * One plain step: `token` at `position`, the next token out. `ahead`: the picks of the plain
   * steps that may follow, for a target that can run them ahead (a verifier may ignore them).
   */
  plain (token: number, position: number, pick: TokenPick, signal: AbortSignal, ahead?: TokenPick[]): Promise<number>
  /**
   * `token` at `position` and `drafts` after it, in one target step; the target's cache then
   * holds the accepted prefix (rejected positions rolled back, now or before the next step).
   * `ahead`: the picks of the plain steps that may follow where no draft stands, for a target that
   * can run them ahead (`ranAhead` in the result: it took them; a verifier may ignore them).
   */
  verify (token: number, position: number, drafts: number[], check: { sampling: SamplerParams, q: Float64Array[] | undefined, rng: Rng }, signal: AbortSignal, ahead?: TokenPick[]): Promise<Acceptance & { ranAhead?: boolean }>
}

/**
 * A whole model's verifier: a greedy verify checked by the target (a verdict; run-ahead after one
 * where no draft stood), else the logits of every verified position, acceptance here and a
 * rollback by KV length (sampled requests, and a target that returns logits).
 */
export function wholeModelVerifier (target: TargetSequence): Verifier {
  const tokenOf = (out: StepOutput): number => {
    if (out.kind !== 'token') throw new EngineError(`a target step with a pick must return a token, not ${out.kind}`)
    return out.id
  }
  return {
    async prefill (promptIds, pick, signal, ahead) {
      return tokenOf(await target.step('prefill', [...promptIds], promptIds.map((_, i) => i), { logitsToKeep: 1, pick, ...(ahead === undefined ? {} : { ahead }) }, signal))
    },
    async plain (token, position, pick, signal, ahead) {
      return tokenOf(await target.step('decode', [token], [position], { logitsToKeep: 1, pick, ...(ahead === undefined ? {} : { ahead }) }, signal))
    },
    async verify (token, position, drafts, { sampling, q, rng }, signal, ahead) {
      const n = drafts.length
      const positions = Array.from({ length: n + 1 }, (_, i) => position + i)
      const greedy = sampling.temperature <= 0
      // Greedy: the engine's worker checks the drafts itself and rolls back the rest (a verdict:
      // ids, not n + 1 rows of logits, and no rollback round trip), and where none stood it runs
      // the plain steps after it ahead, as after a decode step (run-ahead.ts runsAheadAfter).
      const out = await target.step('decode', [token, ...drafts], positions, { logitsToKeep: n + 1, ...(greedy ? { verify: 'greedy' as const, ...(ahead === undefined ? {} : { ahead }) } : {}) }, signal)
      if (out.kind === 'verdict') {
        if (!greedy || !Number.isSafeInteger(out.accepted) || out.accepted < 0 || out.accepted > n) throw new EngineError(`a verify step accepted ${out.accepted} of ${n} drafts`)
        return { accepted: out.accepted, next: out.id, ranAhead: ahead !== undefined && ahead.length > 0 && runsAheadAfter(out.accepted) }
      }
      // Logits: the target checks nothing itself (a verify it ran in chunks, or one that knows no verdicts).
      if (out.kind !== 'logits' || out.count !== n + 1) throw new EngineError(`a verify step must return ${n + 1} logits rows`)
      let result: Acceptance
      if (sampling.temperature <= 0) {
        result = acceptGreedy(drafts, out.data, out.vocab)
      } else {
        const p = Array.from({ length: n + 1 }, (_, i) => distribution(out.data, sampling, i * out.vocab, out.vocab))
        result = acceptSampled(drafts, p, q, rng)
      }
      // The KV holds position .. position + n; keep up to the last accepted draft.
      if (result.accepted < n) await target.rollback(position + 1 + result.accepted, signal)
      return result
    },
  }
}

export interface SpeculationOptions {
  /** Drafts per round: a number, or 'adaptive' (chosen from measured acceptance and costs). Default 'adaptive'. */
  k?: number | 'adaptive'
  /** Upper bound on K (default 16). */
  maxK?: number
  /** K for the first rounds of an adaptive request, and for seeded sampled ones (default 4). */
  initialK?: number
  /** Network time per hop and hops per target traversal, for the cost model (0 on one machine). */
  hopMs?: number
  hops?: number
  /** With an adaptive K of 0, probe with a short round after this many plain steps (default 16). */
  probeEvery?: number
  /**
   * Each probe that accepts nothing doubles the plain steps before the next, up to this many
   * (default 256; `probeEvery` keeps probes evenly spaced); one that accepts resets the spacing.
   */
  maxProbeEvery?: number
  /**
   * Plain steps the target may run ahead (default the engine's RUN_AHEAD_STEPS; 0: none): between
   * rounds, a plain step hands over the picks of the next ones as the plain decode loop does.
   */
  runAhead?: number
  /**
   * How many other sequences decode beside this one on the same engine now (a whole model's
   * micro-batcher): adaptive K weighs what a round that runs alone costs them (adaptive-k.ts).
   */
  peers?: () => number
  /**
   * Speculate only while the request has the engine to itself (no peers): prompt lookup on by
   * default. Measured side by side (results/vs-llamacpp.md): with 8 batched fp32 streams a default
   * lookup that proposed now and then cost 35–38 % of the throughput even with peers in the cost
   * model — every round runs outside the batch — so beside other streams it does not run at all.
   */
  soloOnly?: boolean
}

/** What one sequence's speculation did. */
export interface SpeculationCounts {
  drafter: string
  /** Verification rounds (steps with at least one drafted token). */
  rounds: number
  drafted: number
  accepted: number
  /** Plain one-token steps (K = 0, nothing proposed, or after a drafter failure). */
  plainSteps: number
  /** 1 when the drafter failed and the sequence went on without it. */
  drafterFailures: number
}

export interface SpeculationEvents {
  /** After every verified round. */
  onRound?: (k: number, drafted: number, accepted: number) => void
  onDrafterFailure?: (err: unknown) => void
}

export interface SpeculativeSourceInit extends SpeculationOptions, SpeculationEvents {
  seqId: string
  /** A whole model's sequence (see wholeModelVerifier), or `verifier` for any other target. */
  target?: TargetSequence
  verifier?: Verifier
  drafter: Drafter
  sampling: SamplingParams
  /** Undefined: up to the context end. */
  maxTokens: number | undefined
  maxPositions: number
  vocabSize: number
  now?: () => number
}

export interface SpeculativeSource extends TokenSource {
  counts (): SpeculationCounts
  /** Releases the drafter's state (a draft model's KV). */
  close (): Promise<void>
}

/** Plain steps after a round whose drafts stood that hand the worker no picks (see round). */
const PAUSE_AFTER_STOOD = 4

export function createSpeculativeSource (init: SpeculativeSourceInit): SpeculativeSource {
  const now = init.now ?? (() => performance.now())
  const sampling: SamplerParams = { temperature: init.sampling.temperature, topP: init.sampling.topP }
  const greedy = sampling.temperature <= 0
  const rng: Rng = createRng(init.sampling.seed)
  const maxK = Math.max(0, init.maxK ?? 16)
  const initialK = Math.min(maxK, init.initialK ?? 4)
  // A seeded sampled request keeps one K: the draws then line up the same way on every run,
  // whatever the machine's timings (adaptive K follows them).
  const fixedK = typeof init.k === 'number' ? Math.min(init.k, maxK) : !greedy && init.sampling.seed !== undefined ? initialK : undefined
  const probeEvery = init.probeEvery ?? 16
  // A failed probe is a round of K + 1 positions that yields one token: alone it costs a fraction
  // of a step, but among batched streams it runs outside the batch (the engine runs a
  // several-position step alone) and delays the others' tokens. Where drafts never stand, evenly
  // spaced probes are a round every ~16 tokens for the whole generation; backing off leaves a
  // handful (log2 of the length) and still finds a stretch that starts to repeat.
  const maxProbeEvery = Math.max(probeEvery, init.maxProbeEvery ?? 256)
  let probeGap = probeEvery
  let probing = false
  const tracker: CostTracker = createCostTracker()
  const vocab = init.vocabSize
  const counts: SpeculationCounts = { drafter: init.drafter.name, rounds: 0, drafted: 0, accepted: 0, plainSteps: 0, drafterFailures: 0 }
  const verifier = init.verifier ?? (init.target === undefined ? undefined : wholeModelVerifier(init.target))
  if (verifier === undefined) throw new EngineError('a speculative source needs a target or a verifier')

  let drafter: SequenceDrafter | undefined
  let drafterOpening: Promise<SequenceDrafter | undefined> | undefined
  let closed = false
  let history: number[] = []
  let promptLength = 0
  /** Tokens verified but not yet handed out, in order. */
  const queue: number[] = []
  let plainSinceRound = 0
  // Run-ahead between rounds (greedy, or sampled without a seed: a seeded request's draws must
  // not depend on how many picks a discarded run-ahead took). Picks handed over ahead are used
  // in order by the plain steps that follow, and a round waits until they are (see round).
  // Only a whole model's target runs ahead (a chain's verifier ignores the picks).
  const runAhead = init.target !== undefined && init.verifier === undefined && (greedy || init.sampling.seed === undefined) ? Math.max(0, init.runAhead ?? RUN_AHEAD_STEPS) : 0
  /** Picks drawn for the plain steps after the last one; with run-ahead, the worker holds them. */
  const drawn: TokenPick[] = []
  /** Drafts came while the worker held picks: it gets no more until it holds none (see round). */
  let draining = false
  /** Drafts of the latest round stood (see round). */
  let lastStood = false

  const dropDrafter = (err: unknown): void => {
    counts.drafterFailures = 1
    init.onDrafterFailure?.(err)
    const d = drafter
    drafter = undefined
    void d?.close().catch(() => {})
  }

  /** The picks of the next `n` plain steps, drawn now where not drawn yet, for the target to run ahead; undefined for none. */
  function picksAhead (n: number): TokenPick[] | undefined {
    while (drawn.length < n) drawn.push(nextPick(sampling, rng))
    return n > 0 ? drawn.slice(0, n) : undefined
  }

  /** `handAhead` false: the worker gets no picks past those it holds (see round). */
  async function plainStep (token: number, position: number, signal: AbortSignal, remaining: number, handAhead = true): Promise<number> {
    const t0 = now()
    // This step's pick handed over before: the worker may have computed it ahead, so its time is not a step's cost.
    const ran = drawn.length === 0
    const pick = drawn.shift() ?? nextPick(sampling, rng)
    if (drawn.length === 0) draining = false
    const next = await verifier!.plain(token, position, pick, signal, picksAhead(handAhead ? Math.min(runAhead, remaining) : 0))
    // Every plain step tells what plain decoding costs as it runs (one taken from the run-ahead may
    // have been ready at once: that is its real cost), but one run without run-ahead only because a
    // round was expected: plain decoding would have run it ahead, and counting it would make rounds
    // look better than they are. Only a step that surely ran tells what a verify's single position
    // costs (a round runs alone, nothing computed ahead).
    tracker.plain(now() - t0, ran, runAhead === 0 || handAhead || !ran)
    counts.plainSteps++
    plainSinceRound++
    return next
  }

  /** Under the solo rule, other sequences decode beside this one now: it takes plain steps only. */
  const besidePeers = (): boolean => init.soloOnly === true && (init.peers?.() ?? 0) > 0

  function pickK (position: number): number {
    const generated = history.length - promptLength
    const wanted = init.maxTokens === undefined ? Infinity : init.maxTokens - generated
    // K drafts yield up to K + 1 tokens; past what is wanted or past the context they are waste.
    const cap = Math.max(0, Math.min(maxK, wanted - 1, init.maxPositions - 1 - position))
    if (fixedK !== undefined) return Math.min(fixedK, cap)
    // Adaptive: measure a plain step first (the cost model's base), run a few rounds at the
    // initial K, then let the measurements decide; a K of 0 is re-probed now and then.
    if (counts.plainSteps === 0) return 0
    if (besidePeers()) return 0
    if (tracker.rounds < 2) return Math.min(initialK, cap)
    const k = chooseK(tracker.costs(init.hopMs ?? 0, init.hops ?? 0, init.peers?.() ?? 0), cap)
    if (k === 0 && plainSinceRound >= probeGap) { probing = true; return Math.min(2, cap) }
    return k
  }

  /**
   * Whether the step after this round of `n` drafts would be a plain one should none of them
   * stand: an adaptive K past its first rounds that would then choose 0 (a fixed K verifies at
   * every step). Only such a round hands the worker picks to run on with (see round): with
   * another round next they would only be drained first.
   */
  function plainAfterMiss (n: number): boolean {
    if (fixedK !== undefined || tracker.rounds + 1 < 2) return false
    return chooseK(tracker.costs(init.hopMs ?? 0, init.hops ?? 0, init.peers?.() ?? 0, n), maxK) === 0
  }

  async function round (token: number, position: number, signal: AbortSignal, remaining: number): Promise<number> {
    probing = false
    const k = pickK(position)
    // An adaptive source's first plain step measures a step (the cost model's base), and rounds at
    // the initial K follow it: picks handed to the worker there would only be drained (below).
    // Not beside peers under the solo rule: no round follows there, so its picks are all used.
    const measuring = fixedK === undefined && counts.plainSteps === 0 && !besidePeers()
    if (k === 0 || drafter === undefined) return await plainStep(token, position, signal, remaining, !measuring)
    let proposal: Proposal
    const t0 = now()
    try {
      proposal = await drafter.propose({ context: history, k, sampling, rng, signal })
    } catch (err) {
      signal.throwIfAborted()
      dropDrafter(err)
      return await plainStep(token, position, signal, remaining)
    }
    const drafts = proposal.tokens.slice(0, k).filter(t => Number.isSafeInteger(t) && t >= 0 && t < vocab)
    if (drafts.length < Math.min(k, proposal.tokens.length)) {
      // Out-of-vocabulary ids: a broken drafter; its later tokens are not worth verifying.
      dropDrafter(new EngineError('the drafter proposed token ids outside the vocabulary'))
      return await plainStep(token, position, signal, remaining)
    }
    // Text that has just repeated (the latest round's drafts stood) pauses for a token or two where
    // it differs, then repeats again: the plain steps in that gap hand the worker no picks, so the
    // next proposal is verified at once rather than after the worker's picks drain (a copy task:
    // 5.45× plain decoding with the pause, 4.8× without). Drafts that did not stand get no pause:
    // on a model whose text repeats only in stray matches, serial steps cost more than rounds gain
    // (a pause after every proposal cost tiny fp32 5 %; docs/engine-notes.md, wave 18).
    const pause = lastStood && plainSinceRound < PAUSE_AFTER_STOOD
    if (drafts.length === 0) return await plainStep(token, position, signal, remaining, !draining && !pause)
    // The worker still holds picks of plain steps: it is computing this position's step ahead, or
    // has. A verify now would wait for that run and then throw it away (the worker rolls back what
    // it ran ahead before any other step of the sequence): most of a step lost on every round that
    // follows plain steps. On 250m fp32 (30 ms steps) that made rounds dearer than plain decoding
    // in adaptive K's books, and the default lookup gave 30 tok/s where it gave 45 with run-ahead
    // off (docs/engine-notes.md, wave 18). So take the tokens the worker computes, handing it no
    // more picks until it holds none (`draining`, drafts or not), and verify then if the drafter
    // still proposes (prompt lookup: microseconds; a draft model: a proposal per step taken, only
    // at a switch from plain steps to rounds).
    if (drawn.length > 0) {
      draining = true
      return await plainStep(token, position, signal, remaining, false)
    }
    const t1 = now()
    const n = drafts.length
    // A greedy round whose miss would be followed by plain steps hands the target their picks:
    // where no draft stands, the round yields one token as a plain step does, and the worker runs
    // on from it rather than idling until this thread asks (the verdict says whether it did).
    // Greedy picks draw nothing, so those left unused are dropped.
    const ahead = greedy && plainAfterMiss(n) ? picksAhead(Math.min(runAhead, remaining)) : undefined
    const result = await verifier!.verify(token, position, drafts, { sampling, q: proposal.q?.slice(0, n), rng }, signal, ahead)
    if (result.ranAhead !== true) drawn.length = 0
    if (!Number.isSafeInteger(result.accepted) || result.accepted < 0 || result.accepted > n) throw new EngineError(`the verifier accepted ${result.accepted} of ${n} drafts`)
    const t2 = now()
    tracker.round(n, result.accepted, t1 - t0, t2 - t1)
    counts.rounds++
    counts.drafted += n
    counts.accepted += result.accepted
    lastStood = result.accepted > 0
    plainSinceRound = 0
    if (probing) probeGap = result.accepted > 0 ? probeEvery : Math.min(2 * probeGap, maxProbeEvery)
    init.onRound?.(k, n, result.accepted)
    queue.push(...drafts.slice(0, result.accepted), result.next)
    return queue.shift()!
  }

  return {
    async prefill (promptIds, signal, remaining = 0) {
      history = [...promptIds]
      promptLength = promptIds.length
      // The draft model prefills beside the target (its own worker); a drafter that fails to
      // open leaves the sequence to plain decoding.
      drafterOpening = init.drafter.open(init.seqId, promptIds, signal).catch((err: unknown) => {
        if (!signal.aborted) { counts.drafterFailures = 1; init.onDrafterFailure?.(err) }
        return undefined
      })
      // Beside peers under the solo rule the next steps are plain ones, so the prefill hands the
      // target their picks, as a plain step does: the engine runs the first at once, in its next
      // turn with the others' steps, rather than after a round trip to this thread (a burst of
      // eight requests otherwise split into cohorts that took turns: docs/engine-notes.md, wave 40).
      const pick = nextPick(sampling, rng)
      const [first, d] = await Promise.all([verifier.prefill([...promptIds], pick, signal, picksAhead(besidePeers() ? Math.min(runAhead, remaining) : 0)), drafterOpening])
      if (closed) await d?.close().catch(() => {})
      else drafter = d
      history.push(first)
      return first
    },
    async decode (tokenId, position, signal, remaining = Infinity) {
      if (tokenId !== history[history.length - 1] || position !== history.length - 1) {
        throw new EngineError(`speculative source fed token ${tokenId} at ${position}, expected ${history[history.length - 1]} at ${history.length - 1}`)
      }
      const next = queue.length > 0 ? queue.shift()! : await round(tokenId, position, signal, remaining)
      history.push(next)
      return next
    },
    counts: () => ({ ...counts }),
    async close () {
      closed = true
      const d = drafter ?? await drafterOpening
      drafter = undefined
      await d?.close().catch(() => {})
    },
  }
}
