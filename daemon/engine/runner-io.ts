/**
 * What the dynamic stage runner's two KV layouts share: the sequence they keep (its cache is a row
 * of a block), the stage facts they run with, what one run of the stage graph is fed besides the
 * past KV, and how a batched run's outputs go back to its rows. The layouts themselves —
 * right-aligned caches replaced by each run's presents (runner-padded.ts) and left-aligned caches
 * written in place (runner-in-place.ts) — differ only in how the past is fed and the new KV kept.
 */
import {
  ATTENTION_MASK, GREEDY_TOKEN, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP, POSITION_IDS, pastKeyName, pastValueName,
} from '../../shards/contract.ts'
import { EngineError } from './errors.ts'
import type { BackendSession, HostTensor, TensorMap } from './backend/types.ts'
import type { KvRef } from './kv-block.ts'
import type { BatchStepItem, StageInfo, StepInput } from './protocol.ts'
import { pickToken } from './sampling.ts'
import { droppedError } from './runner-sequences.ts'
import type { BatchStepResult, RunnerSequence } from './runner-sequences.ts'

/** A sequence of the dynamic runner: its cache is a row of a block. */
export interface KvSequence extends RunnerSequence {
  /** Undefined until the first step. */
  kv: KvRef | undefined
  /** The most positions it may reach (BatchStepItem.reach, its latest): room for a block it shares. */
  reach?: number
}

/** A batch item that may run, with its index in the batch. */
export interface Live { index: number, seqId: string, seq: KvSequence, item: BatchStepItem }

/** The stage a runner runs, as its layouts need it. */
export interface RunContext {
  session: BackendSession
  /** The one-position graph's session (StageRunnerInit.decodeSession), for in-place layouts. */
  decodeSession?: BackendSession
  stage: StageInfo
  /** The stage's model layers, in order (index i is the block's layer i). */
  layers: readonly number[]
  kvH: number
  hd: number
  /** The runner's bound on live sequences: no batch has more rows. */
  maxSequences: number
  /**
   * Whether the graph takes num_logits_to_keep: a head's graph (older ones return every position's
   * logits), and a headless stage's where shoal's kernels run its verify steps (native/swap.ts).
   */
  feedsLogitsToKeep: boolean
}

/** How a layout runs steps; the runner picks one by the graph's batch padding. */
export interface KvLayout {
  /**
   * Runs positions [a, b) of a one-sequence step and keeps their KV; `keep`: logits wanted.
   * `greedy`: only the greedy token of the last kept position is wanted, so a graph that gives
   * greedy_token may return that instead of the logits.
   */
  runChunk: (seq: KvSequence, input: StepInput, a: number, b: number, positions: BigInt64Array, keep: number, greedy: boolean) => Promise<TensorMap>
  /** One run for sequences stepping `s` new positions each; one result per entry, in order. */
  runGroup: (group: Live[], s: number) => Promise<BatchStepResult[]>
}

/**
 * The greedy token of row b's last kept position from a run that returned greedy_token [B, K, 1]
 * and no logits; undefined when it returned logits (the caller picks from those).
 */
export function greedyTokenOf (out: TensorMap, b: number): number | undefined {
  const t = greedyTokens(out)
  if (t === undefined) return undefined
  const have = t.dims[1]!
  return Number(t.data[(b + 1) * have - 1]!)
}

/** Every kept position's greedy token of row b, as greedyTokenOf (a verify checks each). */
export function greedyTokensOf (out: TensorMap, b: number): number[] | undefined {
  const t = greedyTokens(out)
  if (t === undefined) return undefined
  const have = t.dims[1]!
  return Array.from(t.data.subarray(b * have, (b + 1) * have), Number)
}

/** A run's greedy_token [B, K, 1], or undefined where it returned logits. */
function greedyTokens (out: TensorMap): Extract<HostTensor, { type: 'int64' }> | undefined {
  if (out[LOGITS] !== undefined) return undefined
  const t = out[GREEDY_TOKEN]
  if (t?.type !== 'int64' || t.dims.length !== 3 || t.dims[2] !== 1) throw new EngineError(`stage graph returned neither float32 logits nor an int64 ${GREEDY_TOKEN} of [B, K, 1]`)
  return t
}

/**
 * The block a group's sequences are exactly the rows of, in order (the previous run's, which may
 * be fed again as is), and the group's longest cache.
 */
export function groupBlock (group: Live[]): { block: KvRef['block'] | undefined, longest: number } {
  let longest = 0
  for (const { seq } of group) longest = Math.max(longest, seq.length)
  const first = group[0]?.seq.kv
  const inOrder = first !== undefined && first.block.rows === group.length &&
    group.every(({ seq }, b) => seq.kv?.block === first.block && seq.kv.row === b)
  return { block: inOrder ? first.block : undefined, longest }
}

export const emptyPast = (ctx: RunContext, rows = 1): HostTensor => ({ type: 'float32', data: new Float32Array(0), dims: [rows, ctx.kvH, 0, ctx.hd] })

/** A one-sequence chunk's feeds: positions [a, b), its mask, its inputs, `past(layer index)` for each layer, logits to keep. */
export function chunkFeeds (ctx: RunContext, input: StepInput, a: number, b: number, positions: BigInt64Array, mask: BigInt64Array, keep: number, past: (i: number) => [HostTensor, HostTensor] | undefined): TensorMap {
  const { stage } = ctx
  const s = b - a
  const feeds: TensorMap = {
    [POSITION_IDS]: { type: 'int64', data: positions.slice(a, b), dims: [1, s] },
    [ATTENTION_MASK]: { type: 'int64', data: mask, dims: [1, mask.length] },
  }
  if (input.kind === 'tokens') {
    feeds[INPUT_IDS] = { type: 'int64', data: input.ids.slice(a, b), dims: [1, s] }
  } else {
    const d = stage.hiddenSize
    feeds[HIDDEN_IN] = { type: 'float32', data: input.data.slice(a * d, b * d), dims: [1, s, d] }
  }
  ctx.layers.forEach((l, i) => {
    const kv = past(i)
    feeds[pastKeyName(l)] = kv?.[0] ?? emptyPast(ctx)
    feeds[pastValueName(l)] = kv?.[1] ?? emptyPast(ctx)
  })
  if (ctx.feedsLogitsToKeep) feeds[NUM_LOGITS_TO_KEEP] = { type: 'int64', data: BigInt64Array.of(BigInt(keep)), dims: [] }
  return feeds
}

/** A group run's feeds other than the past KV. */
export function groupFeeds (ctx: RunContext, group: Live[], s: number, mask: BigInt64Array, total: number): TensorMap {
  const { stage } = ctx
  const rows = group.length
  const positions = new BigInt64Array(rows * s)
  const d = stage.hiddenSize
  const ids = stage.hasEmbedding ? new BigInt64Array(rows * s) : undefined
  const hidden = stage.hasEmbedding ? undefined : new Float32Array(rows * s * d)
  let keep = 1
  group.forEach(({ item }, b) => {
    positions.set(item.positions, b * s)
    if (item.input.kind === 'tokens') ids!.set(item.input.ids, b * s)
    else hidden!.set(item.input.data, b * s * d)
    keep = Math.max(keep, Math.min(item.logitsToKeep, s))
  })
  const feeds: TensorMap = {
    [POSITION_IDS]: { type: 'int64', data: positions, dims: [rows, s] },
    [ATTENTION_MASK]: { type: 'int64', data: mask, dims: [rows, total] },
  }
  if (ids !== undefined) feeds[INPUT_IDS] = { type: 'int64', data: ids, dims: [rows, s] }
  else feeds[HIDDEN_IN] = { type: 'float32', data: hidden!, dims: [rows, s, d] }
  if (ctx.feedsLogitsToKeep) feeds[NUM_LOGITS_TO_KEEP] = { type: 'int64', data: BigInt64Array.of(BigInt(keep)), dims: [] }
  return feeds
}

/** Each row's result of a group run (its token, logits or hidden states), advancing the live rows' lengths. */
export function groupOutputs (stage: StageInfo, group: Live[], s: number, out: TensorMap, adopt: (seq: KvSequence, row: number) => void): BatchStepResult[] {
  const hidden = stage.hasHead ? undefined : out[HIDDEN_OUT]
  if (!stage.hasHead && hidden?.type !== 'float32') throw new EngineError('stage graph returned no float32 hidden_states_out')
  const result = out[LOGITS]
  // Checked before any row advances, as before greedy_token: logits that are there must be float32,
  // and a run without them (a greedy group's) must have returned greedy_token (greedyTokenOf throws).
  if (stage.hasHead && result !== undefined && result.type !== 'float32') throw new EngineError('stage graph returned no float32 logits')
  if (stage.hasHead && result === undefined) greedyTokenOf(out, 0)
  const d = stage.hiddenSize
  return group.map(({ seqId, seq, item }, b): BatchStepResult => {
    if (seq.dropped !== undefined) return { error: droppedError(seqId, seq) }
    adopt(seq, b)
    seq.length += s
    if (hidden?.type === 'float32') return { output: { kind: 'hidden', data: hidden.data.slice(b * s * d, (b + 1) * s * d), count: s, hidden: d } }
    // A greedy group's run may have returned each row's greedy token instead of the logits.
    const greedy = greedyTokenOf(out, b)
    if (greedy !== undefined && item.pick !== undefined) return { output: { kind: 'token', id: greedy } }
    if (result?.type !== 'float32') throw new EngineError('stage graph returned no float32 logits')
    const have = result.dims[1] ?? 1
    const width = result.dims[2] ?? stage.vocabSize
    if (item.pick !== undefined) return { output: { kind: 'token', id: pickToken(result.data, item.pick, ((b + 1) * have - 1) * width, width) } }
    const want = Math.min(item.logitsToKeep, s)
    const data = result.data.slice((b * have + have - want) * width, (b + 1) * have * width)
    return { output: { kind: 'logits', data, count: want, vocab: width } }
  })
}
