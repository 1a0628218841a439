/**
 * The decode loop for one sequence on a whole-model stage engine: prefill the prompt, then sample,
 * detokenize, apply stop strings and feed each token back until EOS, a stop string, max_tokens or
 * the context end. Yields service events (deltas and the end); the caller owns open/free.
 */
import type { FinishReason, GenerateEvent, SamplingParams } from '../service.ts'
import type { TextCodec } from '../text/index.ts'
import { createStopMatcher } from '../text/index.ts'
import { EngineError } from './errors.ts'
import { createRng, sampleToken } from './sampling.ts'
import type { StageEngine } from './stage-engine.ts'

export interface GenerationInput {
  engine: StageEngine
  codec: TextCodec
  seqId: string
  promptIds: number[]
  sampling: SamplingParams
  /** Undefined: up to the context end. */
  maxTokens: number | undefined
  stop: string[]
  eosTokenIds: number[]
  /** Context limit: prompt + completion never exceed it. */
  maxPositions: number
  signal: AbortSignal
}

export async function * generateSequence (g: GenerationInput): AsyncGenerator<Exclude<GenerateEvent, { type: 'start' }>> {
  const rng = createRng(g.sampling.seed)
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
  let out = await g.engine.step(g.seqId, { tokenIds: g.promptIds }, g.promptIds.map((_, i) => i), { logitsToKeep: 1 }, g.signal)
  for (;;) {
    if (out.kind !== 'logits') throw new EngineError('a whole-model engine must return logits')
    const token = sampleToken(out.data, g.sampling, rng, (out.count - 1) * out.vocab, out.vocab)
    completion++
    if (eos.has(token)) { finish = 'stop'; break }
    pendingIds.push(token)
    const pushed = stops.push(detok.push(token))
    // Token ids ride with the text they produced; ids whose text a stop string swallowed still
    // go out (with empty text) so the deltas carry every generated id but EOS.
    if (pushed.text.length > 0 || (pushed.stopped && pendingIds.length > 0)) {
      yield { type: 'delta', text: pushed.text, tokenIds: pendingIds }
      pendingIds = []
    }
    if (pushed.stopped) { finish = 'stop'; stopped = true; break }
    if (completion >= limit || n + completion >= g.maxPositions) { finish = 'length'; break }
    g.signal.throwIfAborted()
    out = await g.engine.step(g.seqId, { tokenIds: [token] }, [n + completion - 1], { logitsToKeep: 1 }, g.signal)
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
