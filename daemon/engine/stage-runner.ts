/**
 * Runs one stage graph for many sequences; lives inside the engine worker (also usable directly).
 * Each sequence's KV cache stays here and never crosses the worker boundary. Long inputs run in
 * chunks (chunked prefill) so memory per run is bounded and a cancel is seen between chunks.
 *
 * Left-padded graphs ('standard' op table): the graph's `present.*` outputs (past + new,
 * concatenated by the graph) become the next step's `past_key_values.*`, so the cache is exactly
 * the live context. `stepBatch` runs several sequences' steps together: items with the same
 * number of new positions S share one run, their past caches left-padded to the longest
 * (attention_mask zeros), so no query row is wasted on padding; the present outputs stay one
 * shared block (kv-block.ts) that the next run of the same sequences takes as its past without a
 * copy. Different S, chunked prefills and graphs without `batchPadding` run one at a time; with
 * `batchPadding: 'equal'` only sequences whose caches have the same length share a run (nothing
 * is padded).
 *
 * With `batchPadding: 'right'` (GroupQueryAttention graphs with per-row lengths) caches are
 * left-aligned instead: a row's live positions are its block's first columns, the attention_mask
 * is ones for them and the new positions, zeros after, and the graph attends over each row's own
 * length — so any mix of lengths shares a run bit-exactly. onnxruntime runs such a graph with
 * batch > 1 only for single-position steps (decode); longer steps run one at a time. A sequence
 * takes its row of a shared block as a view (rows are contiguous), never a copy.
 *
 * Left-aligned caches are kept in place: a sequence's block has room to grow, the graph reads
 * each row's first `length` columns of it, and the runner writes each step's new columns into the
 * row after the run (from the graph's `new_key_values` outputs, so the whole present is never
 * fetched: onnxruntime-node copies every fetched output). A rollback is a shorter length; a block
 * is copied only when its rows change or it runs out of room (kv-block.ts `blockCapacity`).
 *
 * Kept prefixes (left-aligned caches only): `retain` ends a sequence but keeps the first columns
 * of its cache under a key, compacted into a block of its own; `openFrom` starts a new sequence
 * from the first L columns of a kept prefix, so only the rest of its prompt runs. A kept block is
 * never written: a sequence opened from it shares it until its first step, which moves it to a
 * block with room. Which prefixes to keep is the caller's decision (daemon/kv); this only holds
 * the tensors.
 */
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP, POSITION_IDS,
  newKeyName, newValueName, pastKeyName, pastValueName, presentKeyName, presentValueName,
} from '../../shards/contract.ts'
import { ContextLengthError, EngineError, OverloadedError } from './errors.ts'
import type { BackendSession, HostTensor, TensorMap } from './backend/types.ts'
import { blockBytes, blockCapacity, copyRow, copyRowLeft, createScratch, freeBlock, ownRow, packRows, rowView, truncateRow, writeColumns } from './kv-block.ts'
import type { KvBlock, KvRef } from './kv-block.ts'
import type { BatchStepItem, EngineStats, StageInfo, StepInput, StepOutput } from './protocol.ts'
import { pickToken } from './sampling.ts'
import type { TokenPick } from './sampling.ts'
import { checkStepInput, dropSequence, droppedError, rollbackTarget, stepSequence, takeBatch } from './runner-sequences.ts'
import type { BatchStepResult } from './runner-sequences.ts'

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
  /** Undefined until the first step. */
  kv: KvRef | undefined
  length: number
  running: Promise<void> | undefined
  dropped: 'free' | 'cancel' | undefined
}

export interface StageRunner {
  open (seqId: string): void
  /**
   * Runs new positions of one sequence. Callers run one step at a time per runner. With `pick`
   * (last stage only) the output is the token picked from the last position's logits.
   */
  step (seqId: string, input: StepInput, positions: BigInt64Array, logitsToKeep: number, pick?: TokenPick): Promise<StepOutput>
  /**
   * Runs one step for each item (distinct sequences); one result per item, in order. A failed item
   * ends its own sequence only, like a failed step.
   */
  stepBatch (items: BatchStepItem[]): Promise<BatchStepResult[]>
  /**
   * Sets a sequence's cache back to its first `length` positions (speculative decoding: positions
   * the target rejected). Not while a step of it runs.
   */
  rollback (seqId: string, length: number): void
  /** Drops a sequence (waits for its running step to stop at a chunk boundary). Unknown ids are fine. */
  drop (seqId: string, how: 'free' | 'cancel'): Promise<void>
  /**
   * Kept prefixes (optional: a runner without them keeps nothing, and the worker then frees a
   * retained sequence and refuses open-from).
   * retain: ends a sequence, keeping its first min(length, maxLength) positions' KV under `key`;
   * returns the positions kept (0 and nothing kept: unknown sequence or empty cache).
   */
  retain? (seqId: string, key: string, maxLength: number): Promise<{ length: number, bytes: number }>
  /** Opens a sequence whose first `length` positions are those of the kept prefix `key`. */
  openFrom? (seqId: string, key: string, length: number): void
  /** Frees kept prefixes; unknown keys are fine. */
  evict? (keys: readonly string[]): void
  /**
   * The first `length` positions of kept prefix `key` as fresh arrays, per stage layer its key then
   * its value, each [kvHeads, length, headDim] (another node imports them: KV mobility).
   */
  exportPrefix? (key: string, length: number): Float32Array[]
  /**
   * Keeps KV computed elsewhere (laid out as exportPrefix returns it) as prefix `key`: checked for
   * count, shape and finite values, then used as is, exactly like a prefix this runner retained.
   */
  importPrefix? (key: string, length: number, layers: readonly Float32Array[]): { length: number, bytes: number }
  stats (): EngineStats
}

export type { BatchStepResult } from './runner-sequences.ts'

/** The dynamic-graph runner: it keeps prefixes (with left-aligned caches). */
export type PrefixKeepingRunner = StageRunner & Required<Pick<StageRunner, 'retain' | 'openFrom' | 'evict' | 'exportPrefix' | 'importPrefix'>>

interface Live { index: number, seqId: string, seq: Sequence, item: BatchStepItem }

export function createStageRunner (init: StageRunnerInit): PrefixKeepingRunner {
  const { session, stage } = init
  const maxSequences = init.maxSequences ?? DEFAULT_MAX_SEQUENCES
  const chunkSize = init.chunkSize ?? DEFAULT_CHUNK_SIZE
  const layers: number[] = []
  for (let l = stage.layers[0]; l <= stage.layers[1]; l++) layers.push(l)
  const feedsLogitsToKeep = session.inputNames.includes(NUM_LOGITS_TO_KEEP)
  const sequences = new Map<string, Sequence>()
  const { numKvHeads: kvH, headDim: hd } = stage
  const batchable = stage.batchPadding === 'left' || stage.batchPadding === 'equal' || stage.batchPadding === 'right'
  /** Caches aligned at the left (right-padded graphs) rather than at the right. */
  const leftAligned = stage.batchPadding === 'right'
  /** Rows that may share a run: same new positions, and with 'equal' the same cache length too. */
  const groupKey = (s: number, seq: Sequence): string => stage.batchPadding === 'equal' ? `${s}:${seq.length}` : String(s)
  const scratch = createScratch()
  const bytesPerPosition = 2 * layers.length * kvH * hd * 4
  // Left-aligned caches live in blocks with room that each step's new columns are written into.
  // Graphs that output those columns alone (compiler ≥ 5) are fetched without their presents:
  // onnxruntime-node copies every fetched output, and a present is the whole cache, every step.
  const newOutputs = leftAligned && layers.every(l => session.outputNames.includes(newKeyName(l)) && session.outputNames.includes(newValueName(l)))
  const fetches = newOutputs ? [stage.hasHead ? LOGITS : HIDDEN_OUT, ...layers.flatMap(l => [newKeyName(l), newValueName(l)])] : undefined

  const emptyPast = (rows = 1): HostTensor => ({ type: 'float32', data: new Float32Array(0), dims: [rows, kvH, 0, hd] })

  /** Takes a run's present outputs as the new cache block of its `rows` sequences. */
  function presentBlock (out: TensorMap, rows: number, total: number): KvBlock {
    return {
      rows,
      total,
      layers: layers.map(l => {
        const k = out[presentKeyName(l)]
        const v = out[presentValueName(l)]
        if (k?.type !== 'float32' || v?.type !== 'float32') throw new EngineError(`stage graph returned no float32 present KV for layer ${l}`)
        if (k.dims[2] !== total || k.dims[0] !== rows) throw new EngineError(`present.${l}.key has shape [${k.dims.join(', ')}], expected [${rows}, ${kvH}, ${total}, ${hd}]`)
        return [k, v]
      }),
    }
  }

  /**
   * Writes a run's new KV columns into the rows' blocks, in place: row b of the run gets `s`
   * columns at its sequence's length (from new_key_values, or from present's same columns for
   * graphs without them).
   */
  function writeNew (out: TensorMap, targets: ReadonlyArray<{ ref: KvRef, at: number } | undefined>, s: number): void {
    layers.forEach((l, i) => {
      const names = newOutputs ? [newKeyName(l), newValueName(l)] : [presentKeyName(l), presentValueName(l)]
      names.forEach((name, kind) => {
        const t = out[name]
        if (t?.type !== 'float32' || t.dims[0] !== targets.length || t.dims[1] !== kvH || t.dims[3] !== hd) throw new EngineError(`stage graph returned no float32 ${name} of [${targets.length}, ${kvH}, ·, ${hd}]`)
        const srcTotal = t.dims[2]!
        targets.forEach((target, b) => {
          if (target === undefined) return
          const { ref, at } = target
          writeColumns(t.data, b, srcTotal, newOutputs ? 0 : at, ref.block.layers[i]![kind]!.data as Float32Array, ref.row, ref.block.total, at, s, kvH, hd)
        })
      })
    })
  }

  /** Whether a left-aligned sequence may write `need` columns into its block as it is (its own row, room, not a kept prefix). */
  const writable = (ref: KvRef, need: number): boolean => ref.block.total >= need && !isKept(ref.block)

  /** Moves a left-aligned sequence to a block of its own with room for `need` columns (one copy of its live ones). */
  function moveToRoom (seq: Sequence, need: number): void {
    const old = seq.kv
    seq.kv = { block: packRows([{ ref: old, length: seq.length }], blockCapacity(need, stage.maxPositions), layers.length, kvH, hd), row: 0 }
    release(old?.block)
  }

  async function runChunk (seq: Sequence, input: StepInput, a: number, b: number, positions: BigInt64Array, keep: number): Promise<TensorMap> {
    if (leftAligned) return await runChunkInPlace(seq, input, a, b, positions, keep)
    const s = b - a
    const total = seq.length + s
    // Right-aligned caches are fed as exactly their live positions.
    const past = seq.kv === undefined ? 0 : seq.length
    const width = past + s
    const mask = new BigInt64Array(width)
    mask.fill(1n, 0, total)
    const feeds: TensorMap = {
      [POSITION_IDS]: { type: 'int64', data: positions.slice(a, b), dims: [1, s] },
      [ATTENTION_MASK]: { type: 'int64', data: mask, dims: [1, width] },
    }
    if (input.kind === 'tokens') {
      feeds[INPUT_IDS] = { type: 'int64', data: input.ids.slice(a, b), dims: [1, s] }
    } else {
      const d = stage.hiddenSize
      feeds[HIDDEN_IN] = { type: 'float32', data: input.data.slice(a * d, b * d), dims: [1, s, d] }
    }
    layers.forEach((l, i) => {
      const kv = seq.kv === undefined ? undefined : ownRow(seq.kv, seq.length, i, kvH, hd)
      feeds[pastKeyName(l)] = kv?.[0] ?? emptyPast()
      feeds[pastValueName(l)] = kv?.[1] ?? emptyPast()
    })
    if (stage.hasHead && feedsLogitsToKeep) feeds[NUM_LOGITS_TO_KEEP] = { type: 'int64', data: BigInt64Array.of(BigInt(keep)), dims: [] }
    const out = await session.run(feeds)
    const old = seq.kv?.block
    seq.kv = { block: presentBlock(out, 1, width), row: 0 }
    seq.length = total
    release(old)
    return out
  }

  /**
   * One chunk of a left-aligned sequence: its block row is fed whole as the past (the graph reads
   * only the row's first `length` columns: attention_mask is ones for the live positions and the
   * new ones, and no wider), and the chunk's new columns are written into the row after the run.
   * Rolled-back columns are simply overwritten; nothing is copied unless the row must move to a
   * block with more room (or off a kept prefix, which stays as it is).
   */
  async function runChunkInPlace (seq: Sequence, input: StepInput, a: number, b: number, positions: BigInt64Array, keep: number): Promise<TensorMap> {
    const s = b - a
    const total = seq.length + s
    if (seq.kv !== undefined && !writable(seq.kv, total)) moveToRoom(seq, total)
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
      const kv = seq.kv === undefined ? undefined : rowView(seq.kv, i, kvH, hd)
      feeds[pastKeyName(l)] = kv?.[0] ?? emptyPast()
      feeds[pastValueName(l)] = kv?.[1] ?? emptyPast()
    })
    if (stage.hasHead && feedsLogitsToKeep) feeds[NUM_LOGITS_TO_KEEP] = { type: 'int64', data: BigInt64Array.of(BigInt(keep)), dims: [] }
    const out = await session.run(feeds, fetches)
    if (seq.kv === undefined) {
      // Dropped while it ran (drop lets go of the KV first): nothing to keep.
      if (seq.dropped !== undefined) return out
      seq.kv = { block: packRows([{ ref: undefined, length: 0 }], blockCapacity(total, stage.maxPositions), layers.length, kvH, hd), row: 0 }
    }
    // Written even when the sequence was retained meanwhile: retain keeps what whole chunks left.
    writeNew(out, [{ ref: seq.kv, at: seq.length }], s)
    seq.length = total
    return out
  }

  /** Throws what is wrong with a step for this sequence. */
  function check (seqId: string, seq: Sequence, input: StepInput, positions: BigInt64Array, pick: TokenPick | undefined): void {
    checkStepInput(stage, input, positions, pick)
    const s = positions.length
    if (seq.length + s > stage.maxPositions) {
      throw new ContextLengthError(`sequence ${seqId} would hold ${seq.length + s} positions; the context limit is ${stage.maxPositions}`)
    }
  }

  async function run (seqId: string, seq: Sequence, input: StepInput, positions: BigInt64Array, logitsToKeep: number, pick: TokenPick | undefined): Promise<StepOutput> {
    check(seqId, seq, input, positions, pick)
    const s = positions.length
    const keepTotal = Math.min(logitsToKeep, s)
    const parts: Float32Array[] = []
    let rows = 0
    let width = 0
    for (let a = 0, b = 0; a < s; a = b) {
      if (seq.dropped !== undefined) break
      b = Math.min(s, a + chunkSize)
      // Never leave a one-position last chunk: onnxruntime computes a one-position step with
      // another attention kernel (other last bits); longer steps agree however a prompt is split.
      if (s - b === 1 && b - a > 2) b--
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
    if (seq.dropped !== undefined) throw droppedError(seqId, seq)
    if (pick !== undefined) {
      const last = parts[parts.length - 1]!
      return { kind: 'token', id: pickToken(last, pick, last.length - width, width) }
    }
    const data = parts.length === 1 && parts[0]!.byteOffset === 0 && parts[0]!.length === rows * width ? parts[0]! : concat(parts, rows * width)
    return stage.hasHead
      ? { kind: 'logits', data, count: rows, vocab: width }
      : { kind: 'hidden', data, count: rows, hidden: width }
  }

  /**
   * One run for sequences stepping S new positions each (left-padded graphs): past caches
   * left-padded to the longest (or the shared block itself when it is exactly these sequences,
   * in order), new positions aligned, padding masked. Returns one output per entry; entries
   * dropped meanwhile get errors.
   */
  async function runGroup (group: Live[], s: number): Promise<BatchStepResult[]> {
    if (leftAligned) return await runGroupInPlace(group, s)
    const rows = group.length
    let pmax = 0
    for (const { seq } of group) pmax = Math.max(pmax, seq.length)
    const first = group[0]!.seq.kv
    // The previous run's block, fed as is, when it holds exactly these sequences in order.
    const shared = first !== undefined && first.block.rows === rows && first.block.total === pmax &&
      group.every(({ seq }, b) => seq.kv?.block === first.block && seq.kv.row === b)
    const total = pmax + s
    const mask = new BigInt64Array(rows * total)
    group.forEach(({ seq }, b) => mask.fill(1n, b * total + pmax - seq.length, (b + 1) * total))
    const feeds = groupFeeds(group, s, mask, total)
    layers.forEach((l, i) => {
      let pair: [HostTensor, HostTensor]
      if (shared) pair = first.block.layers[i]!
      else if (pmax === 0) pair = [emptyPast(rows), emptyPast(rows)]
      else {
        pair = [0, 1].map(kind => {
          const data = scratch(2 * i + kind, rows * kvH * pmax * hd)
          group.forEach(({ seq }, b) => {
            const src = seq.kv === undefined ? undefined : seq.kv.block.layers[i]![kind]!
            if (src === undefined) copyRow(data, 0, 0, data, b, pmax, 0, kvH, hd) // zero row
            else copyRow(src.data as Float32Array, seq.kv!.row, seq.kv!.block.total, data, b, pmax, seq.length, kvH, hd)
          })
          return { type: 'float32', data, dims: [rows, kvH, pmax, hd] } satisfies HostTensor
        }) as [HostTensor, HostTensor]
      }
      feeds[pastKeyName(l)] = pair[0]
      feeds[pastValueName(l)] = pair[1]
    })
    const out = await session.run(feeds)
    const block = presentBlock(out, rows, total)
    const replaced = new Set<KvBlock>()
    for (const { seq } of group) if (seq.dropped === undefined && seq.kv !== undefined) replaced.add(seq.kv.block)
    const outs = groupOutputs(group, s, out, (seq, b) => { seq.kv = { block, row: b } })
    for (const old of replaced) release(old)
    return outs
  }

  /**
   * One run for left-aligned sequences stepping S new positions each (right-padded graphs): their
   * shared block fed as is when it holds exactly these sequences in order and has room, else the
   * rows packed into a new block with room first (one copy of the live columns, when the batch's
   * membership changed or it outgrew its block); each row attends over its own length, and its
   * new columns are written into its row after the run.
   */
  async function runGroupInPlace (group: Live[], s: number): Promise<BatchStepResult[]> {
    const rows = group.length
    let lmax = 0
    for (const { seq } of group) lmax = Math.max(lmax, seq.length)
    const first = group[0]!.seq.kv
    const shared = first !== undefined && first.block.rows === rows && writable(first, lmax + s) &&
      group.every(({ seq }, b) => seq.kv?.block === first.block && seq.kv.row === b)
    if (!shared) {
      const block = packRows(group.map(({ seq }) => ({ ref: seq.kv, length: seq.length })), blockCapacity(lmax + s, stage.maxPositions), layers.length, kvH, hd)
      const replaced = new Set<KvBlock>()
      group.forEach(({ seq }, b) => {
        if (seq.kv !== undefined) replaced.add(seq.kv.block)
        seq.kv = { block, row: b }
      })
      for (const old of replaced) release(old)
    }
    const block = group[0]!.seq.kv!.block
    const total = lmax + s
    const mask = new BigInt64Array(rows * total)
    group.forEach(({ seq }, b) => mask.fill(1n, b * total, b * total + seq.length + s))
    const feeds = groupFeeds(group, s, mask, total)
    layers.forEach((l, i) => {
      feeds[pastKeyName(l)] = block.layers[i]![0]
      feeds[pastValueName(l)] = block.layers[i]![1]
    })
    const out = await session.run(feeds, fetches)
    // A row dropped meanwhile (drop lets go of its KV first) is skipped; the others are written.
    writeNew(out, group.map(({ seq }) => seq.kv === undefined ? undefined : { ref: seq.kv, at: seq.length }), s)
    return groupOutputs(group, s, out, () => {})
  }

  /** A group run's feeds other than the past KV. */
  function groupFeeds (group: Live[], s: number, mask: BigInt64Array, total: number): TensorMap {
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
    if (stage.hasHead && feedsLogitsToKeep) feeds[NUM_LOGITS_TO_KEEP] = { type: 'int64', data: BigInt64Array.of(BigInt(keep)), dims: [] }
    return feeds
  }

  /** Each row's result of a group run (its token, logits or hidden states), advancing the live rows' lengths. */
  function groupOutputs (group: Live[], s: number, out: TensorMap, adopt: (seq: Sequence, row: number) => void): BatchStepResult[] {
    const result = stage.hasHead ? out[LOGITS] : out[HIDDEN_OUT]
    if (result?.type !== 'float32') throw new EngineError(`stage graph returned no float32 ${stage.hasHead ? 'logits' : 'hidden_states_out'}`)
    const d = stage.hiddenSize
    return group.map(({ seqId, seq, item }, b): BatchStepResult => {
      if (seq.dropped !== undefined) return { error: droppedError(seqId, seq) }
      adopt(seq, b)
      seq.length += s
      if (!stage.hasHead) return { output: { kind: 'hidden', data: result.data.slice(b * s * d, (b + 1) * s * d), count: s, hidden: d } }
      const have = result.dims[1] ?? 1
      const width = result.dims[2] ?? stage.vocabSize
      if (item.pick !== undefined) return { output: { kind: 'token', id: pickToken(result.data, item.pick, ((b + 1) * have - 1) * width, width) } }
      const want = Math.min(item.logitsToKeep, s)
      const data = result.data.slice((b * have + have - want) * width, (b + 1) * have * width)
      return { output: { kind: 'logits', data, count: want, vocab: width } }
    })
  }

  /** Runs checked items: groups (see groupKey) together where the graph allows it, the rest one at a time. */
  async function runBatch (live: Live[], results: BatchStepResult[]): Promise<void> {
    const fail = (e: Live, err: unknown): void => {
      results[e.index] = { error: err instanceof Error ? err : new EngineError(String(err)) }
      // A failed step leaves the cache in an unknown state: the sequence is over.
      if (sequences.get(e.seqId) === e.seq) sequences.delete(e.seqId)
    }
    const groups = new Map<string, Live[]>()
    const solo: Live[] = []
    for (const e of live) {
      try { check(e.seqId, e.seq, e.item.input, e.item.positions, e.item.pick) } catch (err) { fail(e, err); continue }
      const s = e.item.positions.length
      // onnxruntime's GroupQueryAttention runs batch > 1 only for single-position steps.
      if (!batchable || s > chunkSize || (leftAligned && s > 1)) { solo.push(e); continue }
      const key = groupKey(s, e.seq)
      const g = groups.get(key)
      if (g === undefined) groups.set(key, [e])
      else g.push(e)
    }
    for (const group of groups.values()) {
      const s = group[0]!.item.positions.length
      const ready = group.filter(e => e.seq.dropped === undefined || (fail(e, droppedError(e.seqId, e.seq)), false))
      if (ready.length === 1) { solo.push(ready[0]!); continue }
      if (ready.length === 0) continue
      try {
        const outs = await runGroup(ready, s)
        outs.forEach((r, b) => { if ('error' in r) fail(ready[b]!, r.error); else results[ready[b]!.index] = r })
      } catch (err) {
        for (const e of ready) fail(e, err)
      }
    }
    for (const e of solo) {
      try {
        results[e.index] = { output: await run(e.seqId, e.seq, e.item.input, e.item.positions, e.item.logitsToKeep, e.item.pick) }
      } catch (err) { fail(e, err) }
    }
  }

  // ---- kept prefixes (retain / openFrom / evict) ----
  /** Kept prefixes by key: a one-row block of exactly the kept positions. */
  const kept = new Map<string, KvBlock>()

  function isKept (block: KvBlock): boolean {
    for (const k of kept.values()) if (k === block) return true
    return false
  }

  /**
   * Frees a block that lost a reference, unless a sequence or a kept prefix still refers to it.
   * Called only once no run fed with it can still be in flight: after the run that replaced it,
   * and after a dropped sequence's running step ended (a running step's sequence still refers to
   * the block it was fed until the step's result replaces it).
   */
  function release (block: KvBlock | undefined): void {
    if (block === undefined) return
    for (const s of sequences.values()) if (s.kv?.block === block) return
    for (const k of kept.values()) if (k === block) return
    freeBlock(block)
  }

  /** The first `length` columns of a left-aligned row as a one-row block of its own (no copy when it already is one). */
  function compact (ref: KvRef, length: number): KvBlock {
    if (ref.block.rows === 1 && ref.block.total === length) return ref.block
    return {
      rows: 1,
      total: length,
      layers: ref.block.layers.map(pair => pair.map(t => {
        const data = new Float32Array(kvH * length * hd)
        copyRowLeft(t.data as Float32Array, ref.row, ref.block.total, data, 0, length, length, kvH, hd)
        return { type: 'float32', data, dims: [1, kvH, length, hd] } satisfies HostTensor
      }) as [HostTensor, HostTensor]),
    }
  }

  function checkOpen (seqId: string): void {
    if (sequences.has(seqId)) throw new EngineError(`sequence ${seqId} is already open`)
    if (sequences.size >= maxSequences) throw new OverloadedError(`engine holds its maximum of ${maxSequences} live sequences`)
  }

  const prefixOps: Required<Pick<StageRunner, 'retain' | 'openFrom' | 'evict' | 'exportPrefix' | 'importPrefix'>> = {
    async retain (seqId, key, maxLength) {
      if (!leftAligned) throw new EngineError('only graphs with left-aligned caches (batchPadding "right") keep prefixes')
      if (kept.has(key)) throw new EngineError(`a prefix is already kept as ${key}`)
      const seq = sequences.get(seqId)
      if (seq === undefined) return { length: 0, bytes: 0 }
      // Like a free: a step still running stops at its next chunk boundary, and what it left
      // (whole chunks, with their length) is consistent.
      seq.dropped = 'free'
      sequences.delete(seqId)
      await seq.running
      const length = Math.min(seq.length, Math.max(0, Math.floor(maxLength)))
      const ref = seq.kv
      seq.kv = undefined
      if (ref === undefined || length === 0) { release(ref?.block); return { length: 0, bytes: 0 } }
      const block = compact(ref, length)
      kept.set(key, block)
      if (block !== ref.block) release(ref.block)
      return { length, bytes: blockBytes(block) }
    },
    openFrom (seqId, key, length) {
      checkOpen(seqId)
      const block = kept.get(key)
      if (block === undefined) throw new EngineError(`no prefix is kept as ${key}`)
      if (!Number.isSafeInteger(length) || length < 1 || length > block.total) throw new EngineError(`prefix ${key} holds ${block.total} positions, not ${length}`)
      // The kept block is shared as is (its first `length` columns are the sequence's); a kept
      // block is never written, so the first step moves the sequence to a block with room.
      const kv: KvRef = { block, row: 0 }
      sequences.set(seqId, { kv, length, running: undefined, dropped: undefined })
    },
    evict (keys) {
      for (const k of keys) {
        const block = kept.get(k)
        kept.delete(k)
        release(block)
      }
    },
    exportPrefix (key, length) {
      const block = kept.get(key)
      if (block === undefined) throw new EngineError(`no prefix is kept as ${key}`)
      if (!Number.isSafeInteger(length) || length < 1 || length > block.total) throw new EngineError(`prefix ${key} holds ${block.total} positions, not ${length}`)
      // Always a copy: the arrays leave the worker (transferred), and a kept block is shared.
      const out: Float32Array[] = []
      for (const pair of block.layers) {
        for (const t of pair) {
          const data = new Float32Array(kvH * length * hd)
          copyRowLeft(t.data as Float32Array, 0, block.total, data, 0, length, length, kvH, hd)
          out.push(data)
        }
      }
      return out
    },
    importPrefix (key, length, tensors) {
      if (!leftAligned) throw new EngineError('only graphs with left-aligned caches (batchPadding "right") keep prefixes')
      if (kept.has(key)) throw new EngineError(`a prefix is already kept as ${key}`)
      if (!Number.isSafeInteger(length) || length < 1 || length > stage.maxPositions) throw new EngineError(`an imported prefix of ${length} positions does not fit a context of ${stage.maxPositions}`)
      if (tensors.length !== 2 * layers.length) throw new EngineError(`an imported prefix has ${tensors.length} tensors; this stage has ${layers.length} layers (key and value each)`)
      const size = kvH * length * hd
      tensors.forEach((t, i) => {
        if (t.length !== size) throw new EngineError(`imported tensor ${i} holds ${t.length} values, not [${kvH}, ${length}, ${hd}]`)
        // A checksum catches transport damage; a NaN or infinity would still poison every later
        // attention over this prefix, and no computed KV holds one.
        for (let j = 0; j < t.length; j++) if (!Number.isFinite(t[j]!)) throw new EngineError(`imported tensor ${i} holds a non-finite value`)
      })
      const block: KvBlock = {
        rows: 1,
        total: length,
        layers: layers.map((_, i) => [0, 1].map(kind => ({ type: 'float32', data: tensors[2 * i + kind]!, dims: [1, kvH, length, hd] } satisfies HostTensor)) as [HostTensor, HostTensor]),
      }
      kept.set(key, block)
      return { length, bytes: blockBytes(block) }
    },
  }

  return {
    ...prefixOps,
    open (seqId) {
      checkOpen(seqId)
      sequences.set(seqId, { kv: undefined, length: 0, running: undefined, dropped: undefined })
    },
    async step (seqId, input, positions, logitsToKeep, pick) {
      return await stepSequence(sequences, seqId, async seq => await run(seqId, seq, input, positions, logitsToKeep, pick))
    },
    async stepBatch (items) {
      const { results, live } = takeBatch(sequences, items)
      const work = runBatch(live, results)
      const running = work.then(() => {}, () => {})
      for (const e of live) e.seq.running = running
      try {
        await work
      } finally {
        for (const e of live) if (e.seq.running === running) e.seq.running = undefined
      }
      return results
    },
    rollback (seqId, length) {
      const seq = rollbackTarget(sequences.get(seqId), seqId, length)
      if (length === seq.length) return
      // A left-aligned cache rolls back by its length alone: columns past it are never read, and
      // the next step writes right after it (no copy; the paper's "mask and position bookkeeping").
      // A right-aligned one keeps its live columns at the end, so what stays is copied out.
      const old = seq.kv?.block
      if (length === 0) seq.kv = undefined
      else if (!leftAligned && seq.kv !== undefined) seq.kv = { block: truncateRow(seq.kv, seq.length, length, kvH, hd), row: 0 }
      seq.length = length
      if (seq.kv?.block !== old) release(old)
    },
    async drop (seqId, how) {
      const seq = sequences.get(seqId)
      if (seq === undefined) return
      seq.dropped = how
      sequences.delete(seqId)
      const old = seq.kv?.block
      seq.kv = undefined
      await seq.running
      // The running step may have ended by giving the dropped sequence a new block.
      const last = (seq.kv as KvRef | undefined)?.block
      seq.kv = undefined
      release(old)
      release(last)
    },
    stats () {
      const perSeq: Record<string, number> = {}
      const blocks = new Set<KvBlock>()
      let positions = 0
      for (const [id, seq] of sequences) {
        perSeq[id] = seq.length
        if (seq.kv !== undefined) { positions += seq.length; blocks.add(seq.kv.block) }
      }
      let kvHeldBytes = 0
      for (const b of blocks) kvHeldBytes += blockBytes(b)
      let keptBytes = 0
      for (const k of kept.values()) keptBytes += blockBytes(k)
      return { liveSequences: sequences.size, maxSequences, kvBytes: positions * bytesPerPosition, kvHeldBytes, sequences: perSeq, keptPrefixes: kept.size, keptBytes }
    },
  }
}

function concat (parts: Float32Array[], length: number): Float32Array {
  const out = new Float32Array(length)
  let at = 0
  for (const p of parts) { out.set(p, at); at += p.length }
  return out
}
