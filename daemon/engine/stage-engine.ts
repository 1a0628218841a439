/**
 * A stage engine: one stage graph in a worker thread, driven from the daemon's event loop. This is
 * the level the local service, pipeline stages and the micro-batcher build on: open a sequence,
 * step it (token ids or hidden states in; logits or hidden states out), free it. Every call takes
 * an AbortSignal; an aborted step fails with SHOAL_ERR_ABORTED only after the worker has dropped
 * that sequence's KV.
 */
import { randomUUID } from 'node:crypto'
import { Worker } from 'node:worker_threads'
import { deserializeError } from '../errors.ts'
import type { BackendName } from './backend/types.ts'
import { AbortedError, EngineError, ShuttingDownError } from './errors.ts'
import { ENGINE_PROTOCOL_VERSION, int64Of, ownBuffer } from './protocol.ts'
import type { BatchStepItem, EngineStats, FromWorker, StageInfo, StepInput, StepOutput, ToWorker, WorkerInit, WorkerTurn } from './protocol.ts'
import type { TokenPick } from './sampling.ts'
import { createRunAheadTracker, runsAheadAfter } from './run-ahead.ts'
import { DEFAULT_CHUNK_SIZE, DEFAULT_MAX_SEQUENCES } from './stage-runner.ts'
import { codedAbortReason, firstAborted } from '../abort.ts'
import { stepMark } from '../step-trace.ts'

export interface StageEngineInit {
  graphPath: string
  stage: StageInfo
  backend?: BackendName
  device?: string
  threads?: number
  exclusiveCores?: boolean
  maxSequences?: number
  chunkSize?: number
  /** The stage's one-position graph, run for one-position steps over a past (graph-choice.ts decodeGraphWanted); absent: graphPath runs every step. */
  decodeGraphPath?: string
  /** Run the stage's static graphs instead of graphPath (graph-choice.ts resolveGraphChoice). */
  staticGraphs?: WorkerInit['staticGraphs']
  /** The node's compiled-model cache (LoadOptions.cacheDir); absent: none. */
  cacheDir?: string
  /** shoal's kernel library (LoadOptions.kernels); absent: onnxruntime's kernels. */
  kernels?: string
  /** How long loading the graph may take. */
  loadTimeoutMs?: number
}

export type StageStepInput = { tokenIds: number[] } | { hidden: Float32Array }

export interface StepOptions {
  /** Last stage: logits for the last K positions (default 1). */
  logitsToKeep?: number
  /** Last stage: the worker picks the next token and returns only its id ({kind: 'token'}). */
  pick?: TokenPick
  /**
   * Last stage: a greedy speculative verify — a token and its drafts, every position's logits
   * kept; the worker accepts the drafts, rolls back the rest and returns {kind: 'verdict'}
   * (protocol.ts BatchStepItem.verify). The drafts are the token ids after the first, or, for
   * hidden-state input (a chain's last stage), `drafts`.
   */
  verify?: 'greedy'
  drafts?: number[]
}

export interface StageEngine {
  readonly stage: StageInfo
  start (): Promise<void>
  stop (): Promise<void>
  /**
   * Opens a sequence (id generated when not given). An id already open is refused here; the
   * worker's refusal past maxSequences (SHOAL_ERR_OVERLOADED) is what the sequence's first step
   * reports.
   */
  open (seqId?: string, signal?: AbortSignal): Promise<string>
  step (seqId: string, input: StageStepInput, positions: number[], options?: StepOptions, signal?: AbortSignal): Promise<StepOutput>
  free (seqId: string): Promise<void>
  stats (signal?: AbortSignal): Promise<EngineStats>
}

/** One sequence's step within a batch. */
export interface StageBatchItem {
  seqId: string
  input: StageStepInput
  positions: number[]
  logitsToKeep?: number
  /** As StepOptions.pick. */
  pick?: TokenPick
  /** As StepOptions.verify and .drafts. */
  verify?: 'greedy'
  drafts?: number[]
  /**
   * Run-ahead (a one-position decode step with `pick`, or a verify whose verdict accepts nothing:
   * run-ahead.ts runsAheadAfter): the picks of the next steps, in order. The
   * worker runs them as soon as it has the token to feed; the next stepBatch item of this sequence
   * that feeds that token at the next position takes the result computed ahead ({ranAhead: true})
   * instead of a new run. Positions the caller never asks for are not emitted: free, retain (only
   * up to the positions the caller fed) or a step other than the expected one end it.
   */
  ahead?: TokenPick[]
  /** As BatchStepItem.reach: the most positions the sequence may reach (a hint for its cache's room). */
  reach?: number
  /** This item's caller: on abort its sequence is cancelled (KV dropped) and it alone fails. */
  signal?: AbortSignal
}

/**
 * `ranAhead`: the worker had computed it running ahead (no run of this call: not a step time).
 * `run`: the worker's turn that computed it, ahead or not (its rows, positions and time).
 */
export type StageBatchResult = { output: StepOutput, ranAhead?: true, run?: WorkerTurn } | { error: Error }

/** Kept prefixes of finished sequences' KV (left-aligned graphs; see stage-runner.ts). */
export interface PrefixKeepingEngine {
  /** Ends a sequence keeping its first min(length, maxLength) positions as prefix `key`; 0 kept: none. */
  retain (seqId: string, key: string, maxLength: number): Promise<{ length: number, bytes: number }>
  /** Opens `seqId` from the first `length` positions of kept prefix `key`. */
  openFrom (seqId: string, key: string, length: number, signal?: AbortSignal): Promise<string>
  evict (keys: readonly string[]): Promise<void>
  /**
   * The first `length` positions of kept prefix `key`: per stage layer its key then its value,
   * each [kvHeads, length, headDim] float32 (StageRunner.exportPrefix).
   */
  exportPrefix (key: string, length: number, signal?: AbortSignal): Promise<Float32Array[]>
  /** Keeps KV computed elsewhere as prefix `key` (StageRunner.importPrefix); the arrays are transferred. */
  importPrefix (key: string, length: number, layers: Float32Array[], signal?: AbortSignal): Promise<{ length: number, bytes: number }>
}

/** A stage engine that also runs several sequences' steps in one call (see stage-runner.ts). */
export interface BatchingStageEngine extends StageEngine, PrefixKeepingEngine {
  /**
   * One result per item, in order; a failed or aborted item ends its own sequence only. Aborting
   * `signal` aborts every item. Resolves after the worker's run (aborted items included) is over.
   */
  stepBatch (items: StageBatchItem[], signal?: AbortSignal): Promise<StageBatchResult[]>
  /** Sets a sequence's KV back to its first `length` positions (rejected speculative positions); not during its step. */
  rollback (seqId: string, length: number, signal?: AbortSignal): Promise<void>
}

type Reply = Exclude<FromWorker, { type: 'ready' | 'init-error' | 'ahead' }>

export function createStageEngine (init: StageEngineInit): BatchingStageEngine {
  let worker: Worker | undefined
  let dead: Error | undefined
  let nextId = 1
  const pending = new Map<number, { resolve: (r: Reply) => void, reject: (e: Error) => void }>()
  /** Sequences running ahead in the worker. */
  const runAhead = createRunAheadTracker({
    maxPositions: init.stage.maxPositions,
    post: (items) => { if (worker !== undefined && dead === undefined) worker.postMessage({ type: 'ahead-picks', id: nextId++, items } satisfies ToWorker) },
  })

  /**
   * Sequences opened here and not yet freed or retained. An open is posted and not awaited: the
   * worker handles it on arrival, before any step posted after it, so a request's prefill does
   * not wait a worker round trip first (~0.5 ms of a served 128-token TTFT on 60m int4,
   * docs/engine-notes.md, wave 24). What the worker's reply told is kept here instead: a second
   * open of a live id is refused at once (its steps would run on the first one's cache), and an
   * open the worker refused (`refused`) is the error its sequence's first step reports, in place
   * of the worker's "unknown sequence".
   */
  const live = new Set<string>()
  const refused = new Map<string, Error>()
  const claim = (seqId: string): Worker => {
    if (dead !== undefined) throw dead
    if (worker === undefined) throw new EngineError('stage engine is not started')
    if (live.has(seqId)) throw new EngineError(`sequence ${seqId} is already open`)
    live.add(seqId)
    return worker
  }
  const release = (seqId: string): void => { live.delete(seqId); refused.delete(seqId) }
  /** A step's error, or the refusal of its sequence's open that caused it. */
  const stepError = (seqId: string, err: Error): Error => {
    const r = refused.get(seqId)
    if (r === undefined) return err
    refused.delete(seqId)
    return r
  }

  const fail = (err: Error): void => {
    dead ??= err
    for (const p of pending.values()) p.reject(err)
    pending.clear()
    // Callers waiting for a step the worker was running ahead learn it will not come.
    runAhead.failAll(err)
  }

  /** Sends one request; resolves with the worker's reply (errors rejected as ShoalErrors). */
  function call (msg: ToWorker, transfer: ArrayBuffer[] = []): Promise<Reply> {
    if (dead !== undefined) return Promise.reject(dead)
    if (worker === undefined) return Promise.reject(new EngineError('stage engine is not started'))
    const w = worker
    return new Promise<Reply>((resolve, reject) => {
      pending.set(msg.id, { resolve, reject })
      if (msg.type === 'step-batch' || msg.type === 'step') stepMark('m.post')
      w.postMessage(msg, transfer)
    })
  }

  function onMessage (msg: FromWorker): void {
    if (msg.type === 'ahead') { stepMark('m.ahead'); runAhead.onAhead(msg); return }
    if (msg.type === 'ready' || msg.type === 'init-error') return
    if (msg.type === 'stepped-batch' || msg.type === 'stepped') stepMark('m.recv')
    const p = pending.get(msg.id)
    if (p === undefined) return // reply to a request given up on (aborted step)
    pending.delete(msg.id)
    if (msg.type === 'error') p.reject(deserializeError(msg.error))
    else p.resolve(msg)
  }

  /** Races a request against a signal; on abort, `onAbort` runs and its completion decides. */
  async function withSignal<T> (work: Promise<T>, signal: AbortSignal | undefined, onAbort: () => Promise<unknown>): Promise<T> {
    if (signal === undefined) return await work
    if (signal.aborted) { await onAbort(); throw abortReason(signal) }
    let off = (): void => {}
    const aborted = new Promise<never>((_resolve, reject) => {
      const listener = (): void => { onAbort().then(() => reject(abortReason(signal)), reject) }
      signal.addEventListener('abort', listener, { once: true })
      off = () => signal.removeEventListener('abort', listener)
    })
    try {
      return await Promise.race([work, aborted])
    } finally {
      off()
    }
  }

  return {
    stage: init.stage,
    async start () {
      if (worker !== undefined) return
      const data: WorkerInit = {
        version: ENGINE_PROTOCOL_VERSION,
        backend: init.backend ?? 'onnxruntime',
        graphPath: init.graphPath,
        device: init.device ?? 'CPU',
        stage: init.stage,
        maxSequences: init.maxSequences ?? DEFAULT_MAX_SEQUENCES,
        chunkSize: init.chunkSize ?? DEFAULT_CHUNK_SIZE,
        ...(init.threads === undefined ? {} : { threads: init.threads }),
        ...(init.exclusiveCores === undefined ? {} : { exclusiveCores: init.exclusiveCores }),
        ...(init.decodeGraphPath === undefined ? {} : { decodeGraphPath: init.decodeGraphPath }),
        ...(init.staticGraphs === undefined ? {} : { staticGraphs: init.staticGraphs }),
        ...(init.cacheDir === undefined ? {} : { cacheDir: init.cacheDir }),
        ...(init.kernels === undefined ? {} : { kernels: init.kernels }),
      }
      const w = new Worker(new URL('./worker.ts', import.meta.url), { workerData: data })
      worker = w
      await new Promise<void>((resolve, reject) => {
        const timer = setTimeout(() => { reject(new EngineError(`loading ${init.graphPath} took over ${init.loadTimeoutMs ?? 300_000} ms`)) }, init.loadTimeoutMs ?? 300_000)
        const first = (msg: FromWorker): void => {
          clearTimeout(timer)
          if (msg.type === 'ready') resolve()
          else if (msg.type === 'init-error') reject(deserializeError(msg.error))
        }
        w.once('message', first)
        w.once('error', (err) => { clearTimeout(timer); reject(new EngineError(`engine worker failed to start: ${err.message}`, { cause: err })) })
      }).catch(async (err: unknown) => {
        dead = err as Error
        await w.terminate()
        throw err
      })
      w.on('message', onMessage)
      w.on('error', (err) => { fail(new EngineError(`engine worker crashed: ${err.message}`, { cause: err })) })
      w.on('exit', (code) => { fail(new ShuttingDownError(`engine worker exited (code ${code})`)) })
    },
    async stop () {
      const w = worker
      if (w === undefined || dead !== undefined) return
      const closing = call({ type: 'close', id: nextId++ }).catch(() => {})
      const timer = setTimeout(() => { void w.terminate() }, 5_000)
      await closing
      await new Promise<void>(resolve => { if (dead !== undefined) resolve(); else w.once('exit', () => resolve()) })
      clearTimeout(timer)
      fail(new ShuttingDownError())
    },
    async open (seqId = randomUUID(), signal) {
      signal?.throwIfAborted()
      const w = claim(seqId)
      // Not through call(): the refusal is noted as its reply is handled, before any later reply.
      const id = nextId++
      pending.set(id, { resolve: () => {}, reject: (err) => { if (live.has(seqId)) refused.set(seqId, err) } })
      w.postMessage({ type: 'open', id, seqId } satisfies ToWorker)
      return seqId
    },
    async step (seqId, input, positions, options = {}, signal) {
      runAhead.drop(seqId) // the worker rolls back what it ran ahead before this step
      const stepInput: StepInput = 'tokenIds' in input
        ? { kind: 'tokens', ids: int64Of(input.tokenIds) }
        : { kind: 'hidden', data: ownBuffer(input.hidden) }
      const msg: ToWorker = {
        type: 'step',
        id: nextId++,
        seqId,
        input: stepInput,
        positions: int64Of(positions),
        logitsToKeep: options.logitsToKeep ?? 1,
        ...(options.pick === undefined ? {} : { pick: options.pick }),
        ...(options.verify === undefined ? {} : { verify: options.verify }),
        ...(options.drafts === undefined ? {} : { drafts: options.drafts }),
      }
      const transfer = [(stepInput.kind === 'tokens' ? stepInput.ids : stepInput.data).buffer as ArrayBuffer, msg.positions.buffer as ArrayBuffer]
      const reply = await withSignal(call(msg, transfer), signal, async () => {
        pending.delete(msg.id)
        await call({ type: 'cancel', id: nextId++, seqId })
      }).catch((err: unknown) => { throw stepError(seqId, err as Error) })
      if (reply.type !== 'stepped') throw new EngineError(`unexpected reply ${reply.type} to step`)
      return reply.output
    },
    async stepBatch (items, signal) {
      stepMark('e.sb')
      const results: Array<StageBatchResult | undefined> = new Array(items.length)
      const cancels: Array<Promise<unknown>> = []
      const cancel = (seqId: string): void => { runAhead.drop(seqId); cancels.push(call({ type: 'cancel', id: nextId++, seqId }).catch(() => {})) }
      // The batch's signal and the item's, listened to side by side: composing them with
      // AbortSignal.any costs 10–17 µs and a WeakRef on the long-lived batch signal per item and
      // step (engine-notes, wave 9), on the thread that streams the tokens.
      const signalsOf = (item: StageBatchItem): AbortSignal[] => [signal, item.signal].filter(s => s !== undefined)
      type Entry = { item: StageBatchItem, index: number, signals: AbortSignal[] }

      /** One worker run for `entries` (their results filled in). */
      async function runWire (entries: Entry[]): Promise<void> {
        if (entries.length === 0) return
        const wire: BatchStepItem[] = []
        const transfer: ArrayBuffer[] = []
        for (const { item } of entries) {
          const ahead = runAhead.start(item)
          const input: StepInput = 'tokenIds' in item.input
            ? { kind: 'tokens', ids: int64Of(item.input.tokenIds) }
            : { kind: 'hidden', data: ownBuffer(item.input.hidden) }
          const positions = int64Of(item.positions)
          wire.push({ seqId: item.seqId, input, positions, logitsToKeep: item.logitsToKeep ?? 1, ...(item.pick === undefined ? {} : { pick: item.pick }), ...(item.verify === undefined ? {} : { verify: item.verify }), ...(item.drafts === undefined ? {} : { drafts: item.drafts }), ...(ahead === undefined ? {} : { ahead }), ...(item.reach === undefined ? {} : { reach: item.reach }) })
          const buf = (input.kind === 'tokens' ? input.ids : input.data).buffer as ArrayBuffer
          if (!transfer.includes(buf)) transfer.push(buf)
          transfer.push(positions.buffer as ArrayBuffer)
        }
        const offs: Array<() => void> = []
        for (const { item, signals } of entries) {
          if (signals.length === 0) continue
          // Once per sequence, whichever signal aborts first.
          let cancelled = false
          const listener = (): void => { if (!cancelled) { cancelled = true; cancel(item.seqId) } }
          for (const s of signals) s.addEventListener('abort', listener, { once: true })
          offs.push(() => { for (const s of signals) s.removeEventListener('abort', listener) })
        }
        let reply: Reply
        try {
          reply = await call({ type: 'step-batch', id: nextId++, items: wire }, transfer)
        } finally {
          for (const off of offs) off()
        }
        if (reply.type !== 'stepped-batch' || reply.results.length !== wire.length) throw new EngineError(`unexpected reply ${reply.type} to step-batch`)
        entries.forEach(({ item, index, signals }, j) => {
          const r = reply.results[j]!
          const s = firstAborted(signals)
          results[index] = s !== undefined ? { error: abortReason(s) } : 'error' in r ? { error: stepError(item.seqId, deserializeError(r.error)) } : reply.turn === undefined ? r : { ...r, run: reply.turn }
          const got = results[index]
          // A verify whose drafts stood does not run ahead (runsAheadAfter): nothing will come.
          if ('error' in got || (got.output.kind === 'verdict' && !runsAheadAfter(got.output.accepted))) runAhead.drop(item.seqId)
        })
      }

      /** A sequence running ahead: the worker's token if this is the step it ran, else a run of its own. */
      async function takeOrRun (entry: Entry): Promise<void> {
        const r = await runAhead.take(entry.item, entry.signals)
        if (r === undefined) { await runWire([entry]); return }
        results[entry.index] = r
        if (!('error' in r)) runAhead.extend(entry.item)
        else if (firstAborted(entry.signals) !== undefined) cancel(entry.item.seqId)
        else runAhead.drop(entry.item.seqId)
      }

      const direct: Entry[] = []
      const taken: Array<Promise<void>> = []
      items.forEach((item, index) => {
        const signals = signalsOf(item)
        const s = firstAborted(signals)
        if (s !== undefined) { results[index] = { error: abortReason(s) }; cancel(item.seqId); return }
        if (runAhead.has(item.seqId)) taken.push(takeOrRun({ item, index, signals }))
        else direct.push({ item, index, signals })
      })
      await Promise.all([runWire(direct), ...taken])
      await Promise.all(cancels)
      return results as StageBatchResult[]
    },
    async rollback (seqId, length, signal) {
      signal?.throwIfAborted()
      runAhead.drop(seqId)
      await call({ type: 'rollback', id: nextId++, seqId, length })
    },
    async free (seqId) {
      runAhead.drop(seqId)
      release(seqId)
      await call({ type: 'free', id: nextId++, seqId })
    },
    async retain (seqId, key, maxLength) {
      // Positions the worker computed ahead but nobody took are not the sequence's: keep at most those fed.
      const fedTo = runAhead.drop(seqId)
      release(seqId)
      const reply = await call({ type: 'retain', id: nextId++, seqId, key, maxLength: fedTo === undefined ? maxLength : Math.min(maxLength, fedTo) })
      if (reply.type !== 'retained') throw new EngineError(`unexpected reply ${reply.type} to retain`)
      return { length: reply.length, bytes: reply.bytes }
    },
    async openFrom (seqId, key, length, signal) {
      signal?.throwIfAborted()
      claim(seqId)
      try {
        await withSignal(call({ type: 'open-from', id: nextId++, seqId, key, length }), signal, () => call({ type: 'free', id: nextId++, seqId }))
      } catch (err) {
        release(seqId)
        throw err
      }
      return seqId
    },
    async evict (keys) {
      if (keys.length > 0) await call({ type: 'evict', id: nextId++, keys: [...keys] })
    },
    async exportPrefix (key, length, signal) {
      signal?.throwIfAborted()
      // A copy in the worker, answered between steps: nothing to cancel, so an abort only stops the wait.
      const reply = await withSignal(call({ type: 'export-prefix', id: nextId++, key, length }), signal, async () => {})
      if (reply.type !== 'exported') throw new EngineError(`unexpected reply ${reply.type} to export-prefix`)
      return reply.layers
    },
    async importPrefix (key, length, layers, signal) {
      signal?.throwIfAborted()
      const owned = layers.map(t => ownBuffer(t))
      const transfer = [...new Set(owned.map(t => t.buffer as ArrayBuffer))]
      // Not raced against the signal: the worker keeps the prefix either way, and the caller must
      // learn its key's fate to index or evict it.
      const reply = await call({ type: 'import-prefix', id: nextId++, key, length, layers: owned }, transfer)
      if (reply.type !== 'retained') throw new EngineError(`unexpected reply ${reply.type} to import-prefix`)
      return { length: reply.length, bytes: reply.bytes }
    },
    async stats (signal) {
      const reply = await withSignal(call({ type: 'stats', id: nextId++ }), signal, async () => {})
      if (reply.type !== 'stats') throw new EngineError(`unexpected reply ${reply.type} to stats`)
      return reply.stats
    },
  }
}

/** The error an aborted call fails with: the signal's own ShoalError reason, else SHOAL_ERR_ABORTED. */
export function abortReason (signal: AbortSignal): Error {
  return codedAbortReason(signal, () => new AbortedError())
}
