/**
 * The worker_threads boundary of a stage engine, as a protocol: typed message unions, a version,
 * correlation ids, errors as {name, code, message}, cancellation as a message, and tensors as
 * transferable typed arrays (never JSON). `parseToWorker` checks what the worker receives.
 */
import type { SerializedError } from '../errors.ts'
import type { BackendName } from './backend/types.ts'
import type { TokenPick } from './sampling.ts'

/**
 * 2: steps may carry a TokenPick and then return a token id instead of logits. 3: rollback.
 * 4: kept prefixes: retain, open-from, evict. 5: kept prefixes move between nodes: export-prefix,
 * import-prefix (daemon/kv/transport.ts carries them over /shoal/kv/1.0.0). 6: run-ahead: a batch item's
 * `ahead` picks, ahead-picks, and the worker's 'ahead' results. 7: the worker's turn (WorkerTurn) on
 * 'stepped-batch' replies and 'ahead' results. 8: a prefill (a step of several positions) may carry
 * `ahead` picks too, continued from its last position. 9: a batch item's `reach`. 10: greedy verify
 * steps checked in the worker (`verify`, the 'verdict' output), run-ahead after one.
 */
export const ENGINE_PROTOCOL_VERSION = 10

/** What a stage graph looks like from the engine's side (from the shard manifest). */
export interface StageInfo {
  hasEmbedding: boolean
  hasHead: boolean
  /** Inclusive global layer range. */
  layers: [number, number]
  hiddenSize: number
  numKvHeads: number
  headDim: number
  vocabSize: number
  /** Context limit: past + new positions never exceed it. */
  maxPositions: number
  /**
   * 'left': the graph is exact under left padding (attention_mask zeros before a row's past), so
   * several sequences may share one run (stepBatch). 'equal': only sequences whose caches have the
   * same length share a run, unpadded (int8-activation graphs, where padding's last-bit changes
   * would be amplified into different tokens). 'right': rows are right-padded and the graph
   * attends over each row's own length (GroupQueryAttention's per-row lengths), so any mix of
   * lengths shares a run bit-exactly; caches are aligned at the left and only single-position
   * steps (decode) share runs. Absent or 'none': stepBatch runs items one at a time.
   */
  batchPadding?: 'left' | 'right' | 'equal' | 'none'
}

/** workerData of an engine worker. */
export interface WorkerInit {
  version: typeof ENGINE_PROTOCOL_VERSION
  backend: BackendName
  graphPath: string
  /**
   * The stage's one-position graph (StageManifest.decodeGraph, absolute): loaded as a second
   * session that runs the steps graphPath would run down its one-position Ifs. Absent: none.
   */
  decodeGraphPath?: string
  device: string
  threads?: number
  exclusiveCores?: boolean
  stage: StageInfo
  maxSequences: number
  chunkSize: number
  /**
   * Run the stage's static graphs (absolute paths; graph-choice.ts) instead of graphPath's
   * dynamic one: static-runner.ts. Absent: the dynamic graph.
   */
  staticGraphs?: { prefill: string, decode: string, contextLength: number, chunk: number }
  /** The node's compiled-model cache (LoadOptions.cacheDir). */
  cacheDir?: string
  /** shoal's kernel library (LoadOptions.kernels). */
  kernels?: string
}

export type StepInput =
  | { kind: 'tokens', ids: BigInt64Array }
  | { kind: 'hidden', data: Float32Array }

export type StepOutput =
  /** Row-major [count, vocab]: logits of the last `count` positions. */
  | { kind: 'logits', data: Float32Array, count: number, vocab: number }
  /** Row-major [count, hidden]: hidden states of every new position. */
  | { kind: 'hidden', data: Float32Array, count: number, hidden: number }
  /** The token picked from the last position's logits (a last-stage step that carried a TokenPick). */
  | { kind: 'token', id: number }
  /**
   * A greedy verify step's outcome (a last-stage step with `verify`): `accepted` drafts stood and
   * `id` is the target's own token after them. The sequence holds the step's first position and
   * the accepted drafts' (the rest rolled back).
   */
  | { kind: 'verdict', accepted: number, id: number }

export interface EngineStats {
  liveSequences: number
  maxSequences: number
  /** Bytes held by KV caches of live sequences. */
  kvBytes: number
  /** Positions held per live sequence. */
  sequences: Record<string, number>
  /**
   * Bytes of the KV buffers live sequences keep alive: above kvBytes while sequences that ran
   * together share one padded batch buffer (until their next step). Absent from older engines.
   */
  kvHeldBytes?: number
  /** Prefixes kept for reuse (retain) and the bytes their KV holds. Absent from older engines. */
  keptPrefixes?: number
  keptBytes?: number
}

/** One sequence's part of a step-batch message. */
export interface BatchStepItem {
  seqId: string
  input: StepInput
  positions: BigInt64Array
  logitsToKeep: number
  /** Last stage: pick the next token in the worker and return only its id (32k-wide logits stay there). */
  pick?: TokenPick
  /**
   * Run-ahead (a step with `pick` only: a decode step, or a prefill's last chunk; or a verify,
   * see `verify`): the picks of the one-position steps after this one. The worker feeds each
   * picked token back at the position after the step's last at once, without waiting for the
   * main thread, one step per pick, and posts each token in an 'ahead' message; 'ahead-picks'
   * extends the list. It stops when the picks run out, and on free, cancel, retain or rollback of
   * the sequence, or a new step for it (which first rolls its KV back to that step's position).
   */
  ahead?: TokenPick[]
  /**
   * A greedy speculative verify (last stage): a token and the drafts after it, every position's
   * logits kept (logitsToKeep = positions). The worker accepts the drafts that equal its argmax
   * (verdict.ts greedyVerdict), rolls the sequence back past the rest and returns a 'verdict' —
   * ids only, no rows of logits and no rollback round trip. The drafts are the token ids after
   * the first, or, for hidden-state input (a chain's last stage), `drafts`. With `ahead`, and no
   * draft accepted (runsAheadAfter), it runs ahead from its own token as after a decode step:
   * picks[0] is for the step that feeds that token at positions[0] + 1 (token input only).
   */
  verify?: 'greedy'
  /** A hidden-state verify's drafts (see `verify`): one fewer than its positions. */
  drafts?: number[]
  /**
   * The most positions the sequence may hold when its request ends (its prompt and max_tokens,
   * within the context): how much room a block it shares is given (kv-block.ts groupCapacity).
   * A hint, never a limit; the sequence keeps the latest it was given.
   */
  reach?: number
}

/**
 * One turn of the worker's loop: a stepBatch over `rows` items (a step-batch's and the rows it ran
 * ahead beside them) of `positions` positions in all, which took `ms` (its session runs and what
 * the runner does around them; no messages). `id` grows by one a turn, so a result computed ahead
 * and one computed in the same turn name the same run.
 */
export interface WorkerTurn { id: number, rows: number, positions: number, ms: number }

/** A token the worker computed running ahead: `fed` was fed at `position`, and `token` picked from it in `turn`. */
export type AheadResult = { seqId: string, position: number, fed: number, token: number, turn?: WorkerTurn } | { seqId: string, position: number, error: SerializedError }

export type ToWorker =
  | { type: 'open', id: number, seqId: string }
  | { type: 'step', id: number, seqId: string, input: StepInput, positions: BigInt64Array, logitsToKeep: number, pick?: TokenPick, verify?: 'greedy', drafts?: number[] }
  /** Several sequences' steps in as few runs as exactness allows; one result per item, in order. */
  | { type: 'step-batch', id: number, items: BatchStepItem[] }
  /** Drops a sequence's KV; if a step on it is running, that step ends at its next chunk boundary. */
  | { type: 'free', id: number, seqId: string }
  /** Like free, and the running step (if any) fails with SHOAL_ERR_ABORTED. */
  | { type: 'cancel', id: number, seqId: string }
  | { type: 'stats', id: number }
  | { type: 'close', id: number }
  /** Sets a sequence's KV back to its first `length` positions (rejected speculative positions). */
  | { type: 'rollback', id: number, seqId: string, length: number }
  /** Ends a sequence keeping its first min(length, maxLength) positions' KV as prefix `key`; answered by 'retained'. */
  | { type: 'retain', id: number, seqId: string, key: string, maxLength: number }
  /** Opens a sequence from the first `length` positions of kept prefix `key`. */
  | { type: 'open-from', id: number, seqId: string, key: string, length: number }
  /** Frees kept prefixes. */
  | { type: 'evict', id: number, keys: string[] }
  /**
   * More picks for sequences running ahead: `picks[0]` is for the step that feeds position `from`
   * (the one after the last pick given; otherwise the item is stale and ignored). No reply.
   */
  | { type: 'ahead-picks', id: number, items: Array<{ seqId: string, from: number, picks: TokenPick[] }> }
  /** Copies out the first `length` positions of kept prefix `key`; answered by 'exported'. */
  | { type: 'export-prefix', id: number, key: string, length: number }
  /**
   * Keeps KV computed elsewhere as prefix `key` of `length` positions: `layers` holds, per stage
   * layer in order, its key then its value tensor, each [kvHeads, length, headDim] row-major
   * float32 (transferred). Answered by 'retained'.
   */
  | { type: 'import-prefix', id: number, key: string, length: number, layers: Float32Array[] }

export type FromWorker =
  | { type: 'ready', version: typeof ENGINE_PROTOCOL_VERSION, inputNames: string[], outputNames: string[] }
  | { type: 'init-error', error: SerializedError }
  | { type: 'done', id: number }
  | { type: 'stepped', id: number, output: StepOutput }
  | { type: 'stepped-batch', id: number, results: Array<{ output: StepOutput } | { error: SerializedError }>, turn?: WorkerTurn }
  | { type: 'stats', id: number, stats: EngineStats }
  | { type: 'retained', id: number, length: number, bytes: number }
  /** A kept prefix's KV, laid out as import-prefix's `layers` (fresh buffers, transferred). */
  | { type: 'exported', id: number, length: number, layers: Float32Array[] }
  | { type: 'error', id: number, error: SerializedError }
  /** Steps run ahead (no request id: results of the sequences' earlier steps' `ahead` picks). */
  | { type: 'ahead', results: AheadResult[] }

/** Validates a message arriving at the worker; returns an error text when it is malformed. */
export function parseToWorker (msg: unknown): ToWorker | string {
  if (msg === null || typeof msg !== 'object') return 'message is not an object'
  const m = msg as Record<string, unknown>
  if (!Number.isSafeInteger(m.id)) return 'message has no integer id'
  switch (m.type) {
    case 'stats':
    case 'close':
      return m as unknown as ToWorker
    case 'open':
    case 'free':
    case 'cancel':
      return typeof m.seqId === 'string' && m.seqId.length > 0 ? m as unknown as ToWorker : `${m.type}: seqId must be a non-empty string`
    case 'rollback':
      if (typeof m.seqId !== 'string' || m.seqId.length === 0) return 'rollback: seqId must be a non-empty string'
      return Number.isSafeInteger(m.length) && (m.length as number) >= 0 ? m as unknown as ToWorker : 'rollback: length must be a non-negative integer'
    case 'retain':
      if (typeof m.seqId !== 'string' || m.seqId.length === 0 || typeof m.key !== 'string' || m.key.length === 0) return 'retain: seqId and key must be non-empty strings'
      return Number.isSafeInteger(m.maxLength) && (m.maxLength as number) >= 0 ? m as unknown as ToWorker : 'retain: maxLength must be a non-negative integer'
    case 'open-from':
      if (typeof m.seqId !== 'string' || m.seqId.length === 0 || typeof m.key !== 'string' || m.key.length === 0) return 'open-from: seqId and key must be non-empty strings'
      return Number.isSafeInteger(m.length) && (m.length as number) >= 1 ? m as unknown as ToWorker : 'open-from: length must be a positive integer'
    case 'export-prefix':
      if (typeof m.key !== 'string' || m.key.length === 0) return 'export-prefix: key must be a non-empty string'
      return Number.isSafeInteger(m.length) && (m.length as number) >= 1 ? m as unknown as ToWorker : 'export-prefix: length must be a positive integer'
    case 'import-prefix':
      if (typeof m.key !== 'string' || m.key.length === 0) return 'import-prefix: key must be a non-empty string'
      if (!Number.isSafeInteger(m.length) || (m.length as number) < 1) return 'import-prefix: length must be a positive integer'
      return Array.isArray(m.layers) && m.layers.length > 0 && m.layers.every(t => t instanceof Float32Array)
        ? m as unknown as ToWorker
        : 'import-prefix: layers must be a non-empty array of Float32Arrays'
    case 'ahead-picks': {
      if (!Array.isArray(m.items)) return 'ahead-picks: items must be an array'
      for (const item of m.items as unknown[]) {
        const it = item as { seqId?: unknown, from?: unknown, picks?: unknown } | null
        if (it === null || typeof it !== 'object' || typeof it.seqId !== 'string' || it.seqId.length === 0) return 'ahead-picks: each item needs a non-empty seqId'
        if (!Number.isSafeInteger(it.from) || (it.from as number) < 0) return 'ahead-picks: from must be a non-negative integer'
        const bad = checkPicks(it.picks, 'ahead-picks')
        if (bad !== undefined) return bad
      }
      return m as unknown as ToWorker
    }
    case 'evict':
      return Array.isArray(m.keys) && m.keys.every(k => typeof k === 'string') ? m as unknown as ToWorker : 'evict: keys must be an array of strings'
    case 'step': {
      const bad = checkStepFields(m, 'step')
      return bad ?? m as unknown as ToWorker
    }
    case 'step-batch': {
      if (!Array.isArray(m.items) || m.items.length === 0) return 'step-batch: items must be a non-empty array'
      for (const [i, item] of (m.items as unknown[]).entries()) {
        if (item === null || typeof item !== 'object') return `step-batch: items[${i}] is not an object`
        const bad = checkStepFields(item as Record<string, unknown>, `step-batch items[${i}]`)
        if (bad !== undefined) return bad
      }
      return m as unknown as ToWorker
    }
    default:
      // Named without JSON.stringify, which throws on a BigInt (a typed array's elements) or a cycle:
      // a throw here would escape the worker's message handler and take the engine down.
      return `unknown message type ${typeof m.type === 'string' ? JSON.stringify(m.type.slice(0, 64)) : `of type ${typeof m.type}`}`
  }
}

function checkStepFields (m: Record<string, unknown>, what: string): string | undefined {
  if (typeof m.seqId !== 'string' || m.seqId.length === 0) return `${what}: seqId must be a non-empty string`
  if (!(m.positions instanceof BigInt64Array)) return `${what}: positions must be a BigInt64Array`
  if (!Number.isSafeInteger(m.logitsToKeep) || (m.logitsToKeep as number) < 1) return `${what}: logitsToKeep must be a positive integer`
  const input = m.input as { kind?: unknown, ids?: unknown, data?: unknown } | undefined
  const ok = input?.kind === 'tokens' ? input.ids instanceof BigInt64Array
    : input?.kind === 'hidden' ? input.data instanceof Float32Array : false
  if (!ok) return `${what}: input must be {kind:"tokens", ids: BigInt64Array} or {kind:"hidden", data: Float32Array}`
  if (m.reach !== undefined && (!Number.isSafeInteger(m.reach) || (m.reach as number) < 0)) return `${what}: reach must be a non-negative integer`
  if (m.verify !== undefined) {
    if (m.verify !== 'greedy') return `${what}: verify must be "greedy"`
    if (m.pick !== undefined) return `${what}: a verify step takes no pick`
    if (m.positions.length < 2 || m.logitsToKeep !== m.positions.length) return `${what}: a verify step keeps the logits of each of its (two or more) positions`
    const drafts = m.drafts
    if (input?.kind === 'tokens' ? drafts !== undefined : !Array.isArray(drafts) || drafts.length !== m.positions.length - 1 || !drafts.every(t => Number.isSafeInteger(t) && (t as number) >= 0)) {
      return `${what}: a verify's drafts are its token ids after the first, or, for hidden states, \`drafts\` (one fewer than its positions, token ids)`
    }
    if (input?.kind !== 'tokens' && m.ahead !== undefined) return `${what}: a hidden-state verify runs nothing ahead`
  } else if (m.drafts !== undefined) return `${what}: drafts go with a verify`
  const bad = m.pick === undefined ? undefined : checkPick(m.pick, what)
  if (bad !== undefined || m.ahead === undefined) return bad
  if (m.pick === undefined && m.verify === undefined) return `${what}: ahead needs a step with a pick, or a verify`
  return checkPicks(m.ahead, `${what} ahead`)
}

function checkPicks (picks: unknown, what: string): string | undefined {
  if (!Array.isArray(picks)) return `${what}: picks must be an array`
  for (const p of picks) {
    const bad = checkPick(p, what)
    if (bad !== undefined) return bad
  }
  return undefined
}

function checkPick (pick: unknown, what: string): string | undefined {
  const p = pick as Partial<Record<keyof TokenPick, unknown>> | null
  const num = (v: unknown): v is number => typeof v === 'number' && Number.isFinite(v)
  if (p === null || typeof p !== 'object' || !num(p.temperature) || !num(p.topP) || !num(p.u)) return `${what}: pick must be {temperature, topP, u} numbers`
  if (p.temperature < 0 || p.topP <= 0 || p.topP > 1 || p.u < 0 || p.u >= 1) return `${what}: pick needs temperature ≥ 0, topP in (0, 1], u in [0, 1)`
  return undefined
}

/** The drafts a verify step checks (BatchStepItem.verify): its token ids after the first, or its `drafts`. */
export function verifyDrafts (item: Pick<BatchStepItem, 'input' | 'drafts'>): number[] {
  if (item.input.kind === 'tokens') return Array.from(item.input.ids.subarray(1), Number)
  if (item.drafts === undefined) throw new TypeError('a hidden-state verify carries its drafts')
  return item.drafts
}

/**
 * Integers (token ids, positions) as the int64 the graphs take. A plain loop: `BigInt64Array.from(xs,
 * BigInt)` goes through the iterator protocol and took ~10 µs for a 128-token prompt's ids and
 * ~120 µs for 2,000 (3.4 and 15 this way), twice a prefill on the thread that answers requests.
 */
export function int64Of (xs: readonly number[]): BigInt64Array {
  const out = new BigInt64Array(xs.length)
  for (let i = 0; i < xs.length; i++) out[i] = BigInt(xs[i]!)
  return out
}

/** The buffers to transfer with a message (a view over a larger buffer is copied first). */
export function ownBuffer<T extends Float32Array | BigInt64Array> (a: T): T {
  return a.byteOffset === 0 && a.byteLength === a.buffer.byteLength && a.buffer instanceof ArrayBuffer ? a : a.slice() as T
}
