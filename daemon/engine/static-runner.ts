/**
 * A StageRunner over a stage's static graphs (shards/contract.ts, `shoal shard --static`): the
 * fixed-shape pair that NPUs need, runnable by any backend (onnxruntime runs it here, so the path
 * is tested without an NPU). Same interface and semantics as stage-runner.ts, different cache:
 * each sequence owns a KV buffer of CTX slots per layer that the graphs write in place by slot,
 * so the buffer never changes shape. A step's positions run as [1, CHUNK] prefill runs (the last
 * padded) while a whole chunk fits in the buffer, the rest as [1, 1] decode runs. Graphs are
 * batch 1: stepBatch runs its items one at a time. A sequence past CTX positions fails with
 * SHOAL_ERR_CONTEXT_LENGTH before anything runs.
 */
import {
  ATTENTION_MASK, CACHE_POSITION, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, POSITION_IDS,
  pastKeyName, pastValueName, presentKeyName, presentValueName,
} from '../../shards/contract.ts'
import type { BackendSession, HostTensor, TensorMap } from './backend/types.ts'
import { ContextLengthError, EngineError, OverloadedError } from './errors.ts'
import type { BatchStepItem, EngineStats, StageInfo, StepInput, StepOutput } from './protocol.ts'
import { pickToken, type TokenPick } from './sampling.ts'
import { checkStepInput, dropSequence, droppedError, guardStep, rollbackTarget, stepSequence, takeBatch } from './runner-sequences.ts'
import { DEFAULT_MAX_SEQUENCES, type StageRunner } from './stage-runner.ts'

export interface StaticShapesInit {
  /** KV buffer slots (CTX). */
  contextLength: number
  /** Positions per prefill run (CHUNK). */
  chunk: number
}

export interface StaticStageRunnerInit extends StaticShapesInit {
  prefill: BackendSession
  decode: BackendSession
  stage: StageInfo
  maxSequences?: number
}

interface Sequence {
  /** Per layer [key, value] buffers [1, kvH, CTX, hd]; undefined until the first step. */
  kv: Array<[HostTensor, HostTensor]> | undefined
  length: number
  running: Promise<void> | undefined
  dropped: 'free' | 'cancel' | undefined
}

/** The most positions a sequence may hold on static graphs: the KV budget, within the model's limit. */
export function staticContextLimit (stage: Pick<StageInfo, 'maxPositions'>, shapes: StaticShapesInit): number {
  return Math.min(stage.maxPositions, shapes.contextLength)
}

export function createStaticStageRunner (init: StaticStageRunnerInit): StageRunner {
  const { stage, prefill, decode, contextLength: C, chunk } = init
  const maxSequences = init.maxSequences ?? DEFAULT_MAX_SEQUENCES
  const limit = staticContextLimit(stage, init)
  const { numKvHeads: kvH, headDim: hd, hiddenSize: D } = stage
  const layers: number[] = []
  for (let l = stage.layers[0]; l <= stage.layers[1]; l++) layers.push(l)
  const sequences = new Map<string, Sequence>()
  const slotFloats = kvH * C * hd
  // The first step's past: one zero buffer shared by every layer and sequence (backends only read feeds).
  const zeros: HostTensor = { type: 'float32', data: new Float32Array(slotFloats), dims: [1, kvH, C, hd] }
  const bufferBytes = 2 * layers.length * slotFloats * 4
  const bytesPerPosition = 2 * layers.length * kvH * hd * 4

  function check (seqId: string, seq: Sequence, input: StepInput, positions: BigInt64Array, pick: TokenPick | undefined): void {
    checkStepInput(stage, input, positions, pick)
    const s = positions.length
    if (seq.length + s > limit) {
      throw new ContextLengthError(limit < stage.maxPositions
        ? `sequence ${seqId} would hold ${seq.length + s} positions; the static graphs' KV budget is ${limit} (shoal shard --static)`
        : `sequence ${seqId} would hold ${seq.length + s} positions; the context limit is ${limit}`)
    }
  }

  /** One graph run of `real` new positions from index a of the step (padded to the graph's S). */
  async function runOnce (seq: Sequence, input: StepInput, positions: BigInt64Array, a: number, real: number, useChunk: boolean): Promise<TensorMap> {
    const S = useChunk ? chunk : 1
    const pos = new BigInt64Array(S)
    const slots = new BigInt64Array(S)
    for (let i = 0; i < S; i++) {
      // Padding rows continue the positions; their slots follow the real ones, unseen and later overwritten.
      pos[i] = i < real ? positions[a + i]! : positions[a + real - 1]! + BigInt(i - real + 1)
      slots[i] = BigInt(seq.length + i)
    }
    const mask = new BigInt64Array(C)
    mask.fill(1n, 0, seq.length + real)
    const feeds: TensorMap = {
      [POSITION_IDS]: { type: 'int64', data: pos, dims: [1, S] },
      [CACHE_POSITION]: { type: 'int64', data: slots, dims: [S] },
      [ATTENTION_MASK]: { type: 'int64', data: mask, dims: [1, C] },
    }
    if (input.kind === 'tokens') {
      const ids = new BigInt64Array(S)
      ids.set(input.ids.subarray(a, a + real))
      feeds[INPUT_IDS] = { type: 'int64', data: ids, dims: [1, S] }
    } else {
      const h = new Float32Array(S * D)
      h.set(input.data.subarray(a * D, (a + real) * D))
      feeds[HIDDEN_IN] = { type: 'float32', data: h, dims: [1, S, D] }
    }
    layers.forEach((l, i) => {
      const pair = seq.kv?.[i]
      feeds[pastKeyName(l)] = pair?.[0] ?? zeros
      feeds[pastValueName(l)] = pair?.[1] ?? zeros
    })
    const out = await (useChunk ? prefill : decode).run(feeds)
    seq.kv = layers.map(l => {
      const k = out[presentKeyName(l)]
      const v = out[presentValueName(l)]
      if (k?.type !== 'float32' || v?.type !== 'float32') throw new EngineError(`static stage graph returned no float32 present KV for layer ${l}`)
      if (k.data.length !== slotFloats || v.data.length !== slotFloats) throw new EngineError(`present.${l} has shape [${k.dims.join(', ')}], expected [1, ${kvH}, ${C}, ${hd}]`)
      return [k, v]
    })
    seq.length += real
    return out
  }

  async function run (seqId: string, seq: Sequence, input: StepInput, positions: BigInt64Array, logitsToKeep: number, pick: TokenPick | undefined): Promise<StepOutput> {
    check(seqId, seq, input, positions, pick)
    const s = positions.length
    const keepFrom = s - Math.min(logitsToKeep, s)
    const parts: Float32Array[] = []
    let rows = 0
    let width = stage.hasHead ? stage.vocabSize : D
    for (let a = 0; a < s;) {
      if (seq.dropped !== undefined) break
      // A chunk run only while a whole chunk of slots is left: its padding must stay inside the buffer.
      const useChunk = chunk > 1 && s - a > 1 && seq.length + chunk <= C
      const real = useChunk ? Math.min(chunk, s - a) : 1
      const out = await runOnce(seq, input, positions, a, real, useChunk)
      if (stage.hasHead) {
        const logits = out[LOGITS]
        if (logits?.type !== 'float32') throw new EngineError('static stage graph returned no float32 logits')
        width = logits.dims[2] ?? stage.vocabSize
        const from = Math.max(a, keepFrom)
        if (from < a + real) {
          parts.push(logits.data.subarray((from - a) * width, real * width))
          rows += a + real - from
        }
      } else {
        const hidden = out[HIDDEN_OUT]
        if (hidden?.type !== 'float32') throw new EngineError('static stage graph returned no float32 hidden_states_out')
        parts.push(hidden.data.subarray(0, real * D))
        rows += real
      }
      a += real
    }
    if (seq.dropped !== undefined) throw droppedError(seqId, seq)
    if (pick !== undefined) {
      const last = parts[parts.length - 1]!
      return { kind: 'token', id: pickToken(last, pick, last.length - width, width) }
    }
    const data = new Float32Array(rows * width)
    let at = 0
    for (const p of parts) { data.set(p, at); at += p.length }
    return stage.hasHead ? { kind: 'logits', data, count: rows, vocab: width } : { kind: 'hidden', data, count: rows, hidden: width }
  }

  return {
    open (seqId) {
      if (sequences.has(seqId)) throw new EngineError(`sequence ${seqId} is already open`)
      if (sequences.size >= maxSequences) throw new OverloadedError(`engine holds its maximum of ${maxSequences} live sequences`)
      sequences.set(seqId, { kv: undefined, length: 0, running: undefined, dropped: undefined })
    },
    async step (seqId, input, positions, logitsToKeep, pick) {
      return await stepSequence(sequences, seqId, async seq => await run(seqId, seq, input, positions, logitsToKeep, pick))
    },
    rollback (seqId, length) {
      const seq = rollbackTarget(sequences.get(seqId), seqId, length)
      // Slots past the length are masked out and rewritten by the next step: the length is the cache.
      seq.length = length
    },
    async stepBatch (items: BatchStepItem[]) {
      const { results, live } = takeBatch(sequences, items)
      // Batch-1 graphs: one item at a time, each marked running until its own step is over.
      for (const { index, seq, item } of live) {
        if (seq.dropped !== undefined) { results[index] = { error: droppedError(item.seqId, seq) }; continue }
        try {
          results[index] = { output: await guardStep(sequences, item.seqId, seq, async () => await run(item.seqId, seq, item.input, item.positions, item.logitsToKeep, item.pick)) }
        } catch (err) {
          results[index] = { error: err instanceof Error ? err : new EngineError(String(err)) }
        }
      }
      return results
    },
    async drop (seqId, how) {
      await dropSequence(sequences, seqId, how, seq => { seq.kv = undefined })
    },
    stats (): EngineStats {
      const perSeq: Record<string, number> = {}
      let positions = 0
      let held = 0
      for (const [id, seq] of sequences) {
        perSeq[id] = seq.length
        if (seq.kv !== undefined) { positions += seq.length; held += bufferBytes }
      }
      return { liveSequences: sequences.size, maxSequences, kvBytes: positions * bytesPerPosition, kvHeldBytes: held, sequences: perSeq }
    },
  }
}
