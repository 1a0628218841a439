/**
 * Runs one stage graph for many sequences; lives inside the engine worker (also usable directly).
 * Each sequence's KV cache stays here: the graph's `present.*` outputs (past + new, concatenated by
 * the graph) become the next step's `past_key_values.*`, so the cache is exactly the live context
 * and never crosses the worker boundary. Long inputs run in chunks (chunked prefill) so memory per
 * run is bounded and a cancel is seen between chunks.
 */
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP, POSITION_IDS,
  pastKeyName, pastValueName, presentKeyName, presentValueName,
} from '../../shards/contract.ts'
import { AbortedError, ContextLengthError, EngineError, OverloadedError } from './errors.ts'
import type { BackendSession, HostTensor, TensorMap } from './backend/types.ts'
import type { EngineStats, StageInfo, StepInput, StepOutput } from './protocol.ts'

/** Default prefill chunk: big enough to keep matmuls efficient, small enough to bound activations. */
export const DEFAULT_CHUNK_SIZE = 256
export const DEFAULT_MAX_SEQUENCES = 8

export interface StageRunnerInit {
  session: BackendSession
  stage: StageInfo
  maxSequences?: number
  chunkSize?: number
}

interface Sequence {
  /** Per stage layer: [key, value]. Empty until the first step. */
  past: Array<[HostTensor, HostTensor]> | undefined
  length: number
  running: Promise<void> | undefined
  dropped: 'free' | 'cancel' | undefined
}

export interface StageRunner {
  open (seqId: string): void
  /** Runs new positions of one sequence. Callers run one step at a time per runner. */
  step (seqId: string, input: StepInput, positions: BigInt64Array, logitsToKeep: number): Promise<StepOutput>
  /** Drops a sequence (waits for its running step to stop at a chunk boundary). Unknown ids are fine. */
  drop (seqId: string, how: 'free' | 'cancel'): Promise<void>
  stats (): EngineStats
}

export function createStageRunner (init: StageRunnerInit): StageRunner {
  const { session, stage } = init
  const maxSequences = init.maxSequences ?? DEFAULT_MAX_SEQUENCES
  const chunkSize = init.chunkSize ?? DEFAULT_CHUNK_SIZE
  const layers: number[] = []
  for (let l = stage.layers[0]; l <= stage.layers[1]; l++) layers.push(l)
  const feedsLogitsToKeep = session.inputNames.includes(NUM_LOGITS_TO_KEEP)
  const sequences = new Map<string, Sequence>()

  const emptyPast = (): HostTensor => ({ type: 'float32', data: new Float32Array(0), dims: [1, stage.numKvHeads, 0, stage.headDim] })

  async function runChunk (seq: Sequence, input: StepInput, a: number, b: number, positions: BigInt64Array, keep: number): Promise<TensorMap> {
    const s = b - a
    const total = seq.length + s
    const feeds: TensorMap = {
      [POSITION_IDS]: { type: 'int64', data: positions.slice(a, b), dims: [1, s] },
      [ATTENTION_MASK]: { type: 'int64', data: new BigInt64Array(total).fill(1n), dims: [1, total] },
    }
    if (input.kind === 'tokens') {
      feeds[INPUT_IDS] = { type: 'int64', data: input.ids.slice(a, b), dims: [1, s] }
    } else {
      const d = stage.hiddenSize
      feeds[HIDDEN_IN] = { type: 'float32', data: input.data.slice(a * d, b * d), dims: [1, s, d] }
    }
    layers.forEach((l, i) => {
      const kv = seq.past?.[i]
      feeds[pastKeyName(l)] = kv?.[0] ?? emptyPast()
      feeds[pastValueName(l)] = kv?.[1] ?? emptyPast()
    })
    if (stage.hasHead && feedsLogitsToKeep) feeds[NUM_LOGITS_TO_KEEP] = { type: 'int64', data: BigInt64Array.of(BigInt(keep)), dims: [] }
    const out = await session.run(feeds)
    seq.past = layers.map(l => {
      const k = out[presentKeyName(l)]
      const v = out[presentValueName(l)]
      if (k === undefined || v === undefined) throw new EngineError(`stage graph returned no present KV for layer ${l}`)
      if (k.dims[2] !== total) throw new EngineError(`present.${l}.key has length ${k.dims[2]}, expected ${total}`)
      return [k, v]
    })
    seq.length = total
    return out
  }

  async function run (seqId: string, seq: Sequence, input: StepInput, positions: BigInt64Array, logitsToKeep: number): Promise<StepOutput> {
    const s = positions.length
    const given = input.kind === 'tokens' ? input.ids.length : input.data.length / stage.hiddenSize
    if (input.kind === 'tokens' && !stage.hasEmbedding) throw new EngineError('this stage takes hidden states, not token ids')
    if (input.kind === 'hidden' && stage.hasEmbedding) throw new EngineError('this stage takes token ids, not hidden states')
    if (s === 0 || given !== s) throw new EngineError(`step has ${given} inputs for ${s} positions`)
    if (seq.length + s > stage.maxPositions) {
      throw new ContextLengthError(`sequence ${seqId} would hold ${seq.length + s} positions; the context limit is ${stage.maxPositions}`)
    }
    const keepTotal = Math.min(logitsToKeep, s)
    const parts: Float32Array[] = []
    let rows = 0
    let width = 0
    for (let a = 0; a < s; a += chunkSize) {
      if (seq.dropped !== undefined) break
      const b = Math.min(s, a + chunkSize)
      // Logits are wanted for positions [s - keepTotal, s); this chunk holds the suffix from `from`.
      const from = Math.max(a, s - keepTotal)
      const keep = from < b ? b - from : 1
      const out = await runChunk(seq, input, a, b, positions, keep)
      if (stage.hasHead) {
        const logits = out[LOGITS]
        if (logits?.type !== 'float32') throw new EngineError('stage graph returned no float32 logits')
        width = logits.dims[2] ?? stage.vocabSize
        if (from < b) {
          const have = logits.dims[1] ?? 0
          parts.push(logits.data.subarray((have - (b - from)) * width, have * width))
          rows += b - from
        }
      } else {
        const hidden = out[HIDDEN_OUT]
        if (hidden?.type !== 'float32') throw new EngineError('stage graph returned no float32 hidden_states_out')
        width = stage.hiddenSize
        parts.push(hidden.data)
        rows += b - a
      }
    }
    if (seq.dropped !== undefined) throw seq.dropped === 'cancel' ? new AbortedError() : new EngineError(`sequence ${seqId} was freed during a step`)
    const data = parts.length === 1 && parts[0]!.byteOffset === 0 && parts[0]!.length === rows * width ? parts[0]! : concat(parts, rows * width)
    return stage.hasHead
      ? { kind: 'logits', data, count: rows, vocab: width }
      : { kind: 'hidden', data, count: rows, hidden: width }
  }

  return {
    open (seqId) {
      if (sequences.has(seqId)) throw new EngineError(`sequence ${seqId} is already open`)
      if (sequences.size >= maxSequences) throw new OverloadedError(`engine holds its maximum of ${maxSequences} live sequences`)
      sequences.set(seqId, { past: undefined, length: 0, running: undefined, dropped: undefined })
    },
    async step (seqId, input, positions, logitsToKeep) {
      const seq = sequences.get(seqId)
      if (seq === undefined) throw new EngineError(`unknown sequence ${seqId}`)
      if (seq.running !== undefined) throw new EngineError(`sequence ${seqId} already has a step running`)
      const result = run(seqId, seq, input, positions, logitsToKeep)
      seq.running = result.then(() => {}, () => {})
      try {
        return await result
      } catch (err) {
        // A failed step leaves the cache in an unknown state: the sequence is over.
        if (sequences.get(seqId) === seq) sequences.delete(seqId)
        throw err
      } finally {
        seq.running = undefined
      }
    },
    async drop (seqId, how) {
      const seq = sequences.get(seqId)
      if (seq === undefined) return
      seq.dropped = how
      sequences.delete(seqId)
      seq.past = undefined
      await seq.running
    },
    stats () {
      let kvBytes = 0
      const perSeq: Record<string, number> = {}
      for (const [id, seq] of sequences) {
        perSeq[id] = seq.length
        for (const [k, v] of seq.past ?? []) kvBytes += k.data.byteLength + v.data.byteLength
      }
      return { liveSequences: sequences.size, maxSequences, kvBytes, sequences: perSeq }
    },
  }
}

function concat (parts: Float32Array[], length: number): Float32Array {
  const out = new Float32Array(length)
  let at = 0
  for (const p of parts) { out.set(p, at); at += p.length }
  return out
}
