/**
 * Runs one stage graph for many sequences; lives inside the engine worker (also usable directly).
 * Each sequence's KV cache stays here and never crosses the worker boundary. Long inputs run in
 * chunks (chunked prefill) so memory per run is bounded and a cancel is seen between chunks.
 * This file is the sequence bookkeeping and the dispatch; the KV itself is one of two layouts.
 *
 * Left-padded graphs ('standard' op table; runner-padded.ts): a run's present outputs become the
 * next step's past, so the cache is exactly the live context. `stepBatch` runs several sequences'
 * steps together: items with the same number of new positions S share one run, their past caches
 * left-padded to the longest. Different S, chunked prefills and graphs without `batchPadding` run
 * one at a time; with `batchPadding: 'equal'` only sequences whose caches have the same length
 * share a run (nothing is padded).
 *
 * With `batchPadding: 'right'` (GroupQueryAttention graphs with per-row lengths; runner-in-place.ts)
 * caches are left-aligned in blocks with room, each step's new columns written in place, and any
 * mix of lengths shares a run bit-exactly. onnxruntime runs such a graph with batch > 1 only for
 * single-position steps (decode); longer steps run one at a time.
 *
 * Kept prefixes (left-aligned caches only; runner-prefixes.ts): `retain` ends a sequence but keeps
 * the first columns of its cache under a key; `openFrom` starts a new sequence from a kept prefix,
 * so only the rest of its prompt runs.
 */
import { HIDDEN_OUT, LOGITS, newKeyName, NUM_LOGITS_TO_KEEP, presentKeyName } from '../../shards/contract.ts'
import { ContextLengthError, EngineError, OverloadedError } from './errors.ts'
import type { BackendSession } from './backend/types.ts'
import { blockBytes, truncateRow } from './kv-block.ts'
import type { KvBlock, KvRef } from './kv-block.ts'
import { verifyDrafts } from './protocol.ts'
import type { BatchStepItem, EngineStats, StageInfo, StepInput, StepOutput } from './protocol.ts'
import { isGreedy, pickToken } from './sampling.ts'
import type { TokenPick } from './sampling.ts'
import { greedyVerdictOfTokens } from './verdict.ts'
import { checkStepInput, droppedError, rollbackTarget, stepSequence, takeBatch } from './runner-sequences.ts'
import type { BatchStepResult } from './runner-sequences.ts'
import type { KvSequence, Live, RunContext } from './runner-io.ts'
import { greedyTokenOf, greedyTokensOf } from './runner-io.ts'
import { createInPlaceLayout } from './runner-in-place.ts'
import { createPaddedLayout } from './runner-padded.ts'
import { createKeptPrefixes } from './runner-prefixes.ts'

/** Default prefill chunk: big enough to keep matmuls efficient, small enough to bound activations. */
export const DEFAULT_CHUNK_SIZE = 256
export const DEFAULT_MAX_SEQUENCES = 8

export interface StageRunnerInit {
  session: BackendSession
  /**
   * The stage's one-position graph (StageManifest.decodeGraph; in-place caches only): run instead
   * of `session` for steps of one position over a non-empty past buffer, the steps `session`'s
   * graph runs down its one-position Ifs — the same nodes, so the same bits, without the Ifs.
   */
  decodeSession?: BackendSession
  stage: StageInfo
  maxSequences?: number
  chunkSize?: number
}

export interface StageRunner {
  open (seqId: string): void
  /**
   * Runs new positions of one sequence. Callers run one step at a time per runner. With `pick`
   * (last stage only) the output is the token picked from the last position's logits. With
   * `verify` (a greedy verify, protocol.ts BatchStepItem.verify) it may be a verdict on `drafts`
   * from each position's greedy token (else the logits); the caller rolls back what did not stand.
   */
  step (seqId: string, input: StepInput, positions: BigInt64Array, logitsToKeep: number, pick?: TokenPick, verify?: { drafts: readonly number[] }): Promise<StepOutput>
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

export function createStageRunner (init: StageRunnerInit): PrefixKeepingRunner {
  const { session, stage } = init
  const maxSequences = init.maxSequences ?? DEFAULT_MAX_SEQUENCES
  const chunkSize = init.chunkSize ?? DEFAULT_CHUNK_SIZE
  const layers: number[] = []
  for (let l = stage.layers[0]; l <= stage.layers[1]; l++) layers.push(l)
  const feedsLogitsToKeep = session.inputNames.includes(NUM_LOGITS_TO_KEEP)
  const sequences = new Map<string, KvSequence>()
  const { numKvHeads: kvH, headDim: hd } = stage
  const batchable = stage.batchPadding === 'left' || stage.batchPadding === 'equal' || stage.batchPadding === 'right'
  /**
   * Caches aligned at the left (right-padded graphs) rather than at the right; so too for a graph
   * that outputs only its new KV columns (compiler ≥ 5 'ort-contrib'), whatever its batching.
   */
  const leftAligned = stage.batchPadding === 'right' || (!session.outputNames.includes(presentKeyName(stage.layers[0])) && session.outputNames.includes(newKeyName(stage.layers[0])))
  /** Rows that may share a run: same new positions, and with 'equal' the same cache length too. */
  const groupKey = (s: number, seq: KvSequence): string => stage.batchPadding === 'equal' ? `${s}:${seq.length}` : String(s)
  const bytesPerPosition = 2 * layers.length * kvH * hd * 4

  function checkOpen (seqId: string): void {
    if (sequences.has(seqId)) throw new EngineError(`sequence ${seqId} is already open`)
    if (sequences.size >= maxSequences) throw new OverloadedError(`engine holds its maximum of ${maxSequences} live sequences`)
  }

  // Kept prefixes refer to blocks as sequences do, so they decide when a replaced block is freed.
  const prefixes = createKeptPrefixes({ sequences, stage, layerCount: layers.length, kvH, hd, leftAligned, checkOpen })
  const { release } = prefixes
  const { decodeSession } = init
  if (decodeSession !== undefined) {
    const same = (a: readonly string[], b: readonly string[]): boolean => a.length === b.length && a.every(n => b.includes(n))
    if (!leftAligned) throw new EngineError('a one-position graph needs a stage graph that keeps its KV in place')
    if (!same(decodeSession.inputNames, session.inputNames) || !same(decodeSession.outputNames, session.outputNames)) throw new EngineError('the one-position graph\'s inputs or outputs are not the stage graph\'s')
  }
  const ctx: RunContext = { session, ...(decodeSession === undefined ? {} : { decodeSession }), stage, layers, kvH, hd, maxSequences, feedsLogitsToKeep }
  const layout = leftAligned
    ? createInPlaceLayout(ctx, { isKept: prefixes.isKept, release, holders: prefixes.holders, open: () => sequences.size })
    : createPaddedLayout(ctx, release)

  /** Throws what is wrong with a step for this sequence. */
  function check (seqId: string, seq: KvSequence, input: StepInput, positions: BigInt64Array, pick: TokenPick | undefined): void {
    checkStepInput(stage, input, positions, pick)
    const s = positions.length
    if (seq.length + s > stage.maxPositions) {
      throw new ContextLengthError(`sequence ${seqId} would hold ${seq.length + s} positions; the context limit is ${stage.maxPositions}`)
    }
  }

  async function run (seqId: string, seq: KvSequence, input: StepInput, positions: BigInt64Array, logitsToKeep: number, pick: TokenPick | undefined, verify?: { drafts: readonly number[] }): Promise<StepOutput> {
    check(seqId, seq, input, positions, pick)
    const s = positions.length
    const keepTotal = Math.min(logitsToKeep, s)
    const parts: Float32Array[] = []
    let rows = 0
    let width = 0
    // A greedy pick needs only the last position's largest logit, which a graph may give itself;
    // a greedy verify (one chunk: it keeps every position) each position's, and gives its verdict
    // from those (no rows of logits; the caller rolls back what did not stand).
    const checks = verify !== undefined && verify.drafts.length === s - 1 && s <= chunkSize && keepTotal === s
    const greedy = isGreedy(pick) || checks
    let greedyToken: number | undefined
    let verdict: StepOutput | undefined
    for (let a = 0, b = 0; a < s; a = b) {
      if (seq.dropped !== undefined) break
      b = Math.min(s, a + chunkSize)
      // Never leave a one-position last chunk: onnxruntime computes a one-position step with
      // another attention kernel (other last bits); longer steps agree however a prompt is split.
      if (s - b === 1 && b - a > 2) b--
      // Logits are wanted for positions [s - keepTotal, s); this chunk holds the suffix from `from`.
      const from = Math.max(a, s - keepTotal)
      const keep = from < b ? b - from : 1
      const out = await layout.runChunk(seq, input, a, b, positions, keep, greedy)
      if (stage.hasHead) {
        if (checks) {
          const best = greedyTokensOf(out, 0)
          if (best !== undefined) {
            const { accepted, next } = greedyVerdictOfTokens(verify.drafts, best)
            verdict = { kind: 'verdict', accepted, id: next }
            continue
          }
        }
        greedyToken = greedy ? greedyTokenOf(out, 0) : undefined
        if (greedyToken !== undefined) continue
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
    if (verdict !== undefined) return verdict
    if (pick !== undefined) {
      if (greedyToken !== undefined) return { kind: 'token', id: greedyToken }
      const last = parts[parts.length - 1]!
      return { kind: 'token', id: pickToken(last, pick, last.length - width, width) }
    }
    const data = parts.length === 1 && parts[0]!.byteOffset === 0 && parts[0]!.length === rows * width ? parts[0]! : concat(parts, rows * width)
    return stage.hasHead
      ? { kind: 'logits', data, count: rows, vocab: width }
      : { kind: 'hidden', data, count: rows, hidden: width }
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
        const outs = await layout.runGroup(ready, s)
        outs.forEach((r, b) => { if ('error' in r) fail(ready[b]!, r.error); else results[ready[b]!.index] = r })
      } catch (err) {
        for (const e of ready) fail(e, err)
      }
    }
    for (const e of solo) {
      try {
        results[e.index] = { output: await run(e.seqId, e.seq, e.item.input, e.item.positions, e.item.logitsToKeep, e.item.pick, e.item.verify === undefined ? undefined : { drafts: verifyDrafts(e.item) }) }
      } catch (err) { fail(e, err) }
    }
  }

  return {
    ...prefixes.ops,
    open (seqId) {
      checkOpen(seqId)
      sequences.set(seqId, { kv: undefined, length: 0, running: undefined, dropped: undefined })
    },
    async step (seqId, input, positions, logitsToKeep, pick, verify) {
      return await stepSequence(sequences, seqId, async seq => await run(seqId, seq, input, positions, logitsToKeep, pick, verify))
    },
    async stepBatch (items) {
      const { results, live } = takeBatch(sequences, items)
      for (const e of live) if (e.item.reach !== undefined) e.seq.reach = e.item.reach
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
      // A left-aligned cache rolls back by its length alone: columns past it are masked, and
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
      return { liveSequences: sequences.size, maxSequences, kvBytes: positions * bytesPerPosition, kvHeldBytes, sequences: perSeq, ...prefixes.stats() }
    },
  }
}

function concat (parts: Float32Array[], length: number): Float32Array {
  const out = new Float32Array(length)
  let at = 0
  for (const p of parts) { out.set(p, at); at += p.length }
  return out
}
