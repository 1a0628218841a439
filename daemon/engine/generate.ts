/**
 * The decode loop for one sequence over any token source — a whole-model stage engine here, a
 * pipeline chain elsewhere: prefill the prompt (unless the caller did), then detokenize, apply stop strings and feed each
 * token back until EOS, a stop string, max_tokens or the context end. Yields service events
 * (deltas and the end); the caller owns the sequence's lifetime (open/free).
 */
import type { FinishReason, GenerateEvent, GenerateRequest, SamplingParams } from '../service.ts'
import type { Batcher } from '../batcher/index.ts'
import type { TextCodec } from '../text/index.ts'
import { createStopMatcher } from '../text/index.ts'
import { EngineError } from './errors.ts'
import { stepMark } from '../step-trace.ts'
import { createRng, nextPick } from './sampling.ts'
import type { TokenPick } from './sampling.ts'
import type { StageEngine } from './stage-engine.ts'
import type { StepOutput } from './protocol.ts'

/**
 * Where the next token comes from. Sampling happens inside the source (for a pipeline, on the
 * last stage), so only token ids cross into the loop.
 */
export interface TokenSource {
  /**
   * Runs the whole prompt; returns the first generated token. `remaining`: how many decode steps
   * may follow it at most (bounds run-ahead: the engine may run the first of them at once, as it
   * runs a decode step's next); absent: none ahead.
   */
  prefill (promptIds: number[], signal: AbortSignal, remaining?: number): Promise<number>
  /**
   * Feeds back `tokenId` at `position`; returns the next token. `remaining`: how many more decode
   * steps the loop may ask for after this one at most (bounds run-ahead); absent: unknown.
   */
  decode (tokenId: number, position: number, signal: AbortSignal, remaining?: number): Promise<number>
}

/**
 * One step of one sequence: token ids in at positions, the picked next token out. `ahead`: the
 * picks of the next decode steps (run-ahead; a stepper may ignore them).
 */
type Stepper = (kind: 'prefill' | 'decode', tokenIds: number[], positions: number[], pick: TokenPick, signal: AbortSignal, ahead?: TokenPick[]) => Promise<StepOutput | { kind: 'token', id: number }>

/**
 * Decode steps the engine worker may run ahead of the decode loop (stage-engine.ts: the worker feeds
 * back the token it picked without waiting for the main thread). SHOAL_RUN_AHEAD=0 turns it off
 * (benchmarks compare both); tokens are the same either way.
 */
export const RUN_AHEAD_STEPS = runAheadSteps(process.env.SHOAL_RUN_AHEAD)

/** The run-ahead bound from SHOAL_RUN_AHEAD: a non-negative integer, else the default 4. */
export function runAheadSteps (value: string | undefined): number {
  const n = Number(value)
  return value !== undefined && value !== '' && Number.isSafeInteger(n) && n >= 0 ? Math.min(n, 64) : 4
}

/**
 * A token source over a stepper. The sequence's seeded generator stays here and makes each draw
 * before the step; the engine worker picks the token where the logits are, so only its id comes
 * back (not a vocabulary-wide row per token), and the tokens equal sampling here exactly.
 */
function pickingSource (step: Stepper, sampling: SamplingParams, prefilled: number, aheadSteps = 0): TokenSource {
  const rng = createRng(sampling.seed)
  // Picks are drawn in step order whether or not steps run ahead: a step's draw is the same.
  const drawn: TokenPick[] = []
  const draw = (): TokenPick => drawn.shift() ?? nextPick(sampling, rng)
  const token = (out: StepOutput | { kind: 'token', id: number }): number => {
    if (out.kind !== 'token') throw new EngineError(`a whole-model step with a pick must return a token, not ${out.kind}`)
    return out.id
  }
  return {
    async prefill (promptIds, signal, remaining = 0) {
      // The first `prefilled` positions are already in the sequence's KV (a reused prefix).
      const ids = promptIds.slice(prefilled)
      return await run('prefill', ids, ids.map((_, i) => prefilled + i), signal, remaining)
    },
    async decode (tokenId, position, signal, remaining = Infinity) {
      return await run('decode', [tokenId], [position], signal, remaining)
    },
  }

  /** A step with its own pick and, for up to `remaining` steps after it, the picks the engine may run them ahead with. */
  async function run (kind: 'prefill' | 'decode', ids: number[], positions: number[], signal: AbortSignal, remaining: number): Promise<number> {
    const pick = draw()
    const ahead = Math.min(aheadSteps, remaining)
    if (!(ahead > 0)) return token(await step(kind, ids, positions, pick, signal))
    while (drawn.length < ahead) drawn.push(nextPick(sampling, rng))
    return token(await step(kind, ids, positions, pick, signal, drawn.slice(0, ahead)))
  }
}

/**
 * A token source over one sequence of a whole-model stage engine. `prefilled`: the sequence opened
 * holding the prompt's first positions (a reused prefix), so prefill runs only the rest.
 */
export function engineTokenSource (engine: StageEngine, seqId: string, sampling: SamplingParams, prefilled = 0): TokenSource {
  return pickingSource(async (_kind, tokenIds, positions, pick, signal) =>
    await engine.step(seqId, { tokenIds }, positions, { logitsToKeep: 1, pick }, signal), sampling, prefilled)
}

/**
 * A token source over one sequence whose steps go through a micro-batcher (so they share runs
 * with other sequences' steps). The caller releases the sequence. `budgetMs`: its prefill's own
 * queue budget (StepRequest.budgetMs), the batcher's when undefined.
 */
export function batchedTokenSource (batcher: Batcher, seqId: string, sampling: SamplingParams, prefilled = 0, aheadSteps = RUN_AHEAD_STEPS, budgetMs?: number, reach?: number): TokenSource {
  return pickingSource(async (kind, tokenIds, positions, pick, signal, ahead) =>
    await batcher.submit({ seqId, kind, input: { tokenIds }, positions, logitsToKeep: 1, pick, ...(ahead === undefined ? {} : { ahead }), ...prefillFields(kind, budgetMs, reach) }, signal), sampling, prefilled, aheadSteps)
}

/**
 * How many decode steps may follow a prefill at most: its token is the completion's first, and
 * max_tokens and the context end bound the rest (EOS and stop strings may end it sooner).
 */
export function afterPrefill (maxTokens: number | undefined, maxPositions: number, promptLength: number): number {
  return Math.max(0, Math.min(maxTokens ?? Infinity, maxPositions - promptLength) - 1)
}

/**
 * What only a prefill's step carries, those given: its own queue budget, which only a prefill's
 * admission reads (StepRequest.budgetMs), and how far its sequence may reach (StepRequest.reach),
 * which decode steps need not repeat.
 */
export function prefillFields (kind: 'prefill' | 'decode', budgetMs: number | undefined, reach: number | undefined): { budgetMs?: number, reach?: number } {
  if (kind !== 'prefill') return {}
  return { ...(budgetMs === undefined ? {} : { budgetMs }), ...(reach === undefined ? {} : { reach }) }
}

/** A request's end conditions on a model: its max_tokens and stop strings, the model's EOS ids and context limit. */
export function endConditions (request: Pick<GenerateRequest, 'maxTokens' | 'stop'>, manifest: { generation: { eosTokenIds: number[] }, shape: { maxPositions: number } }): Pick<GenerationInput, 'maxTokens' | 'stop' | 'eosTokenIds' | 'maxPositions'> {
  return { maxTokens: request.maxTokens, stop: request.stop, eosTokenIds: manifest.generation.eosTokenIds, maxPositions: manifest.shape.maxPositions }
}

export interface GenerationInput {
  source: TokenSource
  /**
   * The first generated token when the caller ran the prefill itself (before `start`, so that a
   * refusal there is still an HTTP error); otherwise the loop prefills.
   */
  first?: number | undefined
  codec: TextCodec
  promptIds: number[]
  /** Undefined: up to the context end. */
  maxTokens: number | undefined
  stop: string[]
  eosTokenIds: number[]
  /** Context limit: prompt + completion never exceed it. */
  maxPositions: number
  signal: AbortSignal
}

export async function * generateSequence (g: GenerationInput): AsyncGenerator<Exclude<GenerateEvent, { type: 'start' }>> {
  const detok = g.codec.detokenizer()
  const stops = createStopMatcher(g.stop)
  const eos = new Set(g.eosTokenIds)
  const n = g.promptIds.length
  const limit = g.maxTokens ?? Infinity
  let pendingIds: number[] = []
  let completion = 0
  let finish: FinishReason = 'length'
  let stopped = false

  if (limit <= 0) {
    yield { type: 'end', finishReason: 'length', usage: { promptTokens: n, completionTokens: 0 } }
    return
  }
  // Decode steps that may follow the prefill; `completion` of them have run before each next one.
  const after = afterPrefill(g.maxTokens, g.maxPositions, n)
  let token = g.first ?? await g.source.prefill(g.promptIds, g.signal, after)
  // The next step is submitted before this token's delta is yielded: the engine computes it while
  // the consumer detokenizes, writes and signs, so a token costs max(step, consumer) instead of
  // their sum. Everything that decides whether there is a next step is known before the yield.
  let next: Promise<number> | undefined
  try {
    for (;;) {
      completion++
      if (eos.has(token)) { finish = 'stop'; break }
      pendingIds.push(token)
      const pushed = stops.push(detok.push(token))
      const more = !pushed.stopped && completion < limit && n + completion < g.maxPositions
      stepMark('g.pushed')
      if (more) {
        g.signal.throwIfAborted()
        // At most this many steps may follow this one (max_tokens, the context end; EOS and stop strings may end it sooner).
        next = g.source.decode(token, n + completion - 1, g.signal, after - completion)
        // Observed now, awaited after the yield: a failure while the consumer holds the delta is
        // not an unhandled rejection.
        next.catch(() => {})
      }
      // Token ids ride with the text they produced; ids whose text a stop string swallowed still
      // go out (with empty text) so the deltas carry every generated id but EOS.
      if (pushed.text.length > 0 || (pushed.stopped && pendingIds.length > 0)) {
        yield { type: 'delta', text: pushed.text, tokenIds: pendingIds }
        pendingIds = []
      }
      if (pushed.stopped) { finish = 'stop'; stopped = true; break }
      if (next === undefined) { finish = 'length'; break }
      const pending = next
      next = undefined
      token = await pending
      stepMark('g.tok')
    }
  } finally {
    // The consumer left while a step was in flight (it aborts the signal when a client goes): let
    // that one step settle before the caller frees the sequence under it.
    if (next !== undefined) await next.catch(() => {})
  }
  // Flush what the detokenizer and stop matcher still hold (unless a stop string already ended it).
  if (!stopped) {
    const tail = stops.push(detok.flush())
    const text = tail.text + (tail.stopped ? '' : stops.flush())
    if (text.length > 0 || pendingIds.length > 0) yield { type: 'delta', text, tokenIds: pendingIds }
    if (tail.stopped) finish = 'stop'
  }
  yield { type: 'end', finishReason: finish, usage: { promptTokens: n, completionTokens: completion } }
}
