/**
 * Engine worker entry: loads one stage graph on one backend/device and serves the protocol in
 * protocol.ts. `session.run` blocks the thread it runs on, which is why it runs here and not on
 * the daemon's event loop. Steps run one at a time in arrival order; open/free/cancel/stats are
 * answered between steps (the backend yields between chunks).
 *
 * Run-ahead: a batch item with `ahead` picks leaves a continuation behind — its sequence's next
 * input is the token just picked, so the worker runs that step at once instead of idling until the
 * main thread sends it (a worker→main→worker round trip and the main thread's per-token work off
 * the critical path). Each loop turn runs, in one stepBatch, every step that arrived meanwhile and
 * one step of every continuation that still has a pick, and posts the continuations' tokens as
 * 'ahead' messages (a short turn's with the next turn's: run-ahead.ts aheadPostDue). The main
 * thread keeps control: it hands out picks a few steps at a time (the bound), and a free,
 * cancel, retain or rollback ends a continuation; the positions computed beyond what the main
 * thread used are never emitted (retain keeps only those it names; a new step for the sequence
 * rolls its KV back first).
 */
import { performance } from 'node:perf_hooks'
import { parentPort, workerData } from 'node:worker_threads'
import { serializeError } from '../errors.ts'
import { loadBackend } from './backend/index.ts'
import type { BackendSession } from './backend/types.ts'
import { EngineError } from './errors.ts'
import { ENGINE_PROTOCOL_VERSION, ownBuffer, parseToWorker, verifyDrafts } from './protocol.ts'
import type { AheadResult, BatchStepItem, FromWorker, StepOutput, ToWorker, WorkerInit, WorkerTurn } from './protocol.ts'
import { greedyVerdict } from './verdict.ts'
import type { TokenPick } from './sampling.ts'
import { aheadPostDue, runsAheadAfter } from './run-ahead.ts'
import { createStageRunner } from './stage-runner.ts'
import { dumpStepTrace, stepMark } from '../step-trace.ts'
import { createStaticStageRunner } from './static-runner.ts'
import type { StageRunner } from './stage-runner.ts'

if (parentPort === null) throw new Error('daemon/engine/worker.ts must run in a worker thread')
const port = parentPort

const post = (msg: FromWorker, transfer: ArrayBuffer[] = []): void => { port.postMessage(msg, transfer) }

async function main (init: WorkerInit): Promise<void> {
  if (init.version !== ENGINE_PROTOCOL_VERSION) throw new EngineError(`engine protocol ${String(init.version)} is not ${ENGINE_PROTOCOL_VERSION}`)
  const backend = await loadBackend(init.backend)
  const options = {
    device: init.device,
    ...(init.threads === undefined ? {} : { threads: init.threads }),
    ...(init.exclusiveCores === undefined ? {} : { exclusiveCores: init.exclusiveCores }),
    ...(init.cacheDir === undefined ? {} : { cacheDir: init.cacheDir }),
    ...(init.kernels === undefined ? {} : { kernels: init.kernels }),
  }
  let session: BackendSession
  let runner: StageRunner
  if (init.staticGraphs === undefined) {
    const main = await backend.load(init.graphPath, options)
    const decodeSession = init.decodeGraphPath === undefined ? undefined : await backend.load(init.decodeGraphPath, options).catch(async (err: unknown) => { await main.close(); throw err })
    session = decodeSession === undefined ? main : { ...main, close: async () => { await main.close(); await decodeSession.close() } }
    runner = createStageRunner({ session: main, ...(decodeSession === undefined ? {} : { decodeSession }), stage: init.stage, maxSequences: init.maxSequences, chunkSize: init.chunkSize })
  } else {
    const { prefill: prefillPath, decode: decodePath, contextLength, chunk } = init.staticGraphs
    const prefill = await backend.load(prefillPath, options)
    const decode = await backend.load(decodePath, options)
    session = { inputNames: prefill.inputNames, outputNames: prefill.outputNames, run: async (f) => await prefill.run(f), close: async () => { await prefill.close(); await decode.close() } }
    runner = createStaticStageRunner({ prefill, decode, stage: init.stage, maxSequences: init.maxSequences, contextLength, chunk })
  }
  const scheduler = createScheduler(runner, session)
  port.on('message', (raw: unknown) => {
    stepMark('w.recv')
    const msg = parseToWorker(raw)
    if (typeof msg === 'string') {
      const id = (raw as { id?: unknown } | null)?.id
      post({ type: 'error', id: typeof id === 'number' ? id : -1, error: serializeError(new EngineError(`malformed engine message: ${msg}`)) })
      return
    }
    if (msg.type === 'step' || msg.type === 'step-batch' || msg.type === 'rollback') {
      // In order with the runs (a rollback must not land while a step of its sequence runs ahead).
      scheduler.enqueue(msg)
    } else if (msg.type === 'ahead-picks') {
      scheduler.morePicks(msg.items)
    } else {
      if (msg.type === 'free' || msg.type === 'cancel' || msg.type === 'retain') scheduler.end(msg.seqId)
      if (msg.type === 'close') scheduler.endAll() // nothing runs ahead into a closing session
      void handle(msg, runner, session)
    }
  })
  post({ type: 'ready', version: ENGINE_PROTOCOL_VERSION, inputNames: [...session.inputNames], outputNames: [...session.outputNames] })
}

/**
 * A sequence running ahead: feed `token` at `position` next, with `picks[0]` (picks[i] is for
 * position + i). While its step runs, `position` is already the one after it.
 */
interface Continuation { token: number, position: number, picks: TokenPick[] }

type Ordered = Extract<ToWorker, { type: 'step' | 'step-batch' | 'rollback' }>

/** Steps (and rollbacks) in arrival order, merged with the steps of sequences running ahead. */
function createScheduler (runner: StageRunner, session: BackendSession): { enqueue (msg: Ordered): void, morePicks (items: Array<{ seqId: string, from: number, picks: TokenPick[] }>): void, end (seqId: string): void, endAll (): void } {
  const continuations = new Map<string, Continuation>()
  const waiting: Ordered[] = []
  let looping = false
  /**
   * Tokens run ahead and not yet posted, and over how many turns (aheadPostDue). Posted before
   * anything the main thread sends about sequences is handled, so an 'ahead' message never
   * arrives after the main thread stepped, rolled back or ended a sequence it speaks of.
   */
  let held: AheadResult[] = []
  /** WorkerTurn ids. */
  let turns = 0
  let heldTurns = 0
  const flush = (): void => {
    if (held.length === 0) return
    stepMark('w.ahead')
    post({ type: 'ahead', results: held })
    held = []
    heldTurns = 0
  }

  const kick = (): void => { if (!looping) void loop() }

  async function loop (): Promise<void> {
    looping = true
    let batches: Array<Extract<Ordered, { type: 'step-batch' }>> = []
    try {
      for (;;) {
        const msgs = waiting.splice(0)
        if (msgs.length > 0) flush()
        batches = []
        for (const msg of msgs) {
          if (msg.type === 'step-batch') { batches.push(msg); continue }
          // A step or rollback of a sequence running ahead: the main thread took it back.
          settle(msg.seqId, msg.type === 'step' ? Number(msg.positions[0]) : undefined)
          await handle(msg, runner, session)
        }
        const items: BatchStepItem[] = []
        for (const b of batches) {
          for (const item of b.items) {
            settle(item.seqId, Number(item.positions[0]))
            items.push(item)
          }
        }
        const ahead: Array<{ seqId: string, position: number, fed: number }> = []
        for (const [seqId, c] of continuations) {
          const pick = c.picks.shift()
          if (pick === undefined) continue
          ahead.push({ seqId, position: c.position, fed: c.token })
          items.push({ seqId, input: { kind: 'tokens', ids: BigInt64Array.of(BigInt(c.token)) }, positions: BigInt64Array.of(BigInt(c.position)), logitsToKeep: 1, pick })
          c.position++
        }
        if (items.length === 0) { flush(); return }
        const started = performance.now()
        let results: Awaited<ReturnType<StageRunner['stepBatch']>>
        try {
          results = await runner.stepBatch(items)
        } catch (err) {
          results = items.map(() => ({ error: err instanceof Error ? err : new EngineError(String(err)) }))
        }
        // What this turn cost, for the main thread's step-time model: it sees a result computed
        // ahead only when it takes it, and a step's round trip with whatever ran beside it.
        const turn: WorkerTurn = { id: ++turns, rows: items.length, positions: items.reduce((n, it) => n + it.positions.length, 0), ms: performance.now() - started }
        let at = 0
        for (const b of batches) {
          const mine = results.slice(at, at + b.items.length)
          b.items.forEach((item, i) => {
            let r = mine[i]!
            if (item.verify !== undefined && 'output' in r) r = mine[i] = verdictResult(runner, item, r.output)
            if (item.ahead === undefined || !('output' in r)) return
            if (r.output.kind === 'token') {
              continuations.set(item.seqId, { token: r.output.id, position: Number(item.positions[item.positions.length - 1]) + 1, picks: [...item.ahead] })
            } else if (r.output.kind === 'verdict' && runsAheadAfter(r.output.accepted)) {
              continuations.set(item.seqId, { token: r.output.id, position: Number(item.positions[0]) + 1, picks: [...item.ahead] })
            }
          })
          at += b.items.length
          postBatch(b.id, mine, turn)
        }
        const out: AheadResult[] = ahead.map(({ seqId, position, fed }, i) => {
          const r = results[at + i]!
          const c = continuations.get(seqId)
          if ('output' in r && r.output.kind === 'token') {
            if (c !== undefined) c.token = r.output.id
            return { seqId, position, fed, token: r.output.id, turn }
          }
          continuations.delete(seqId)
          return { seqId, position, error: serializeError('error' in r ? r.error : new EngineError(`a step run ahead returned ${r.output.kind}`)) }
        })
        if (out.length > 0) {
          held.push(...out)
          heldTurns++
          // A sequence that cannot run its next step without the main thread gets its tokens now.
          const stalled = out.some(r => 'error' in r || continuations.get(r.seqId)?.picks.length === 0)
          if (aheadPostDue({ turnMs: performance.now() - started, heldTurns, waiting: stalled })) flush()
        }
        batches = []
      }
    } catch (err) {
      // Not expected (the runner reports failures per item): nobody is left waiting — batches get
      // the error, and so do callers waiting for a step run ahead.
      flush()
      const error = serializeError(err)
      for (const b of batches) post({ type: 'error', id: b.id, error })
      if (continuations.size > 0) post({ type: 'ahead', results: [...continuations].map(([seqId, c]) => ({ seqId, position: c.position, error })) })
      continuations.clear()
    } finally {
      looping = false
      if (waiting.length > 0) kick()
    }
  }

  /**
   * Ends a continuation because the main thread sent this sequence a step (at `position`) or a
   * rollback itself: positions computed ahead from `position` on are rolled back (never emitted).
   */
  function settle (seqId: string, position: number | undefined): void {
    if (!continuations.delete(seqId)) return
    const held = runner.stats().sequences[seqId]
    if (position === undefined || held === undefined || held <= position) return
    // Between runs no step of it is running, so this does not fail; were it to, the sequence ends
    // (its step fails as unknown) rather than running on positions nobody asked for.
    try { runner.rollback(seqId, position) } catch { void runner.drop(seqId, 'cancel') }
  }

  return {
    enqueue (msg) { waiting.push(msg); kick() },
    morePicks (items) {
      for (const { seqId, from, picks } of items) {
        const c = continuations.get(seqId)
        // Ended meanwhile (the main thread no longer waits on it), or meant for an earlier one.
        if (c === undefined || from !== c.position + c.picks.length) continue
        c.picks.push(...picks)
      }
      kick()
    },
    end (seqId) { flush(); continuations.delete(seqId) },
    endAll () { flush(); continuations.clear() },
  }
}

/**
 * A greedy verify's verdict (protocol.ts BatchStepItem.verify): the runner's, from each position's
 * greedy token, or taken here from the step's logits (a runner or run that gave those) against its
 * drafts (verifyDrafts). The sequence is rolled back past those that did not stand, here between
 * runs, before any other step of it.
 */
function verdictOf (runner: StageRunner, item: Pick<BatchStepItem, 'seqId' | 'input' | 'positions' | 'drafts'>, output: StepOutput): StepOutput {
  const n = item.positions.length
  let verdict: Extract<StepOutput, { kind: 'verdict' }>
  if (output.kind === 'verdict') {
    verdict = output
  } else {
    if (output.kind !== 'logits' || output.count !== n) throw new EngineError(`a verify step must return logits for each of its ${n} positions`)
    const { accepted, next } = greedyVerdict(verifyDrafts(item), output.data, output.vocab)
    verdict = { kind: 'verdict', accepted, id: next }
  }
  if (verdict.accepted < n - 1) runner.rollback(item.seqId, Number(item.positions[0]) + 1 + verdict.accepted)
  return verdict
}

function verdictResult (runner: StageRunner, item: BatchStepItem, output: StepOutput): { output: StepOutput } | { error: Error } {
  try {
    return { output: verdictOf(runner, item, output) }
  } catch (err) {
    return { error: err instanceof Error ? err : new EngineError(String(err)) }
  }
}

/** Posts a batch's results (logits and hidden rows transferred, each buffer once). */
function postBatch (id: number, results: Awaited<ReturnType<StageRunner['stepBatch']>>, turn?: WorkerTurn): void {
  const transfer = new Set<ArrayBuffer>()
  const wire = results.map(r => {
    if ('error' in r) return { error: serializeError(r.error) }
    if (r.output.kind === 'token' || r.output.kind === 'verdict') return { output: r.output as StepOutput }
    const data = ownBuffer(r.output.data)
    if (transfer.has(data.buffer as ArrayBuffer)) return { output: { ...r.output, data: data.slice() } }
    transfer.add(data.buffer as ArrayBuffer)
    return { output: { ...r.output, data } }
  })
  stepMark('w.post')
  post({ type: 'stepped-batch', id, results: wire, ...(turn === undefined ? {} : { turn }) }, [...transfer])
}

async function handle (msg: ToWorker, runner: StageRunner, session: BackendSession): Promise<void> {
  try {
    switch (msg.type) {
      case 'open':
        runner.open(msg.seqId)
        post({ type: 'done', id: msg.id })
        return
      case 'step': {
        const run = await runner.step(msg.seqId, msg.input, msg.positions, msg.logitsToKeep, msg.pick, msg.verify === undefined ? undefined : { drafts: verifyDrafts(msg) })
        const output = msg.verify === undefined ? run : verdictOf(runner, msg, run)
        if (output.kind === 'token' || output.kind === 'verdict') {
          stepMark('w.post')
          post({ type: 'stepped', id: msg.id, output })
          return
        }
        const data = ownBuffer(output.data)
        post({ type: 'stepped', id: msg.id, output: { ...output, data } }, [data.buffer as ArrayBuffer])
        return
      }
      case 'step-batch':
        postBatch(msg.id, await runner.stepBatch(msg.items))
        return
      case 'rollback':
        runner.rollback(msg.seqId, msg.length)
        post({ type: 'done', id: msg.id })
        return
      case 'free':
      case 'cancel':
        await runner.drop(msg.seqId, msg.type)
        post({ type: 'done', id: msg.id })
        return
      case 'stats':
        post({ type: 'stats', id: msg.id, stats: runner.stats() })
        return
      case 'retain': {
        // A runner that keeps no prefixes (static graphs) frees the sequence and keeps nothing.
        const kept = runner.retain === undefined
          ? await runner.drop(msg.seqId, 'free').then(() => ({ length: 0, bytes: 0 }))
          : await runner.retain(msg.seqId, msg.key, msg.maxLength)
        post({ type: 'retained', id: msg.id, ...kept })
        return
      }
      case 'open-from':
        if (runner.openFrom === undefined) throw new EngineError('this stage runner keeps no prefixes')
        runner.openFrom(msg.seqId, msg.key, msg.length)
        post({ type: 'done', id: msg.id })
        return
      case 'export-prefix': {
        if (runner.exportPrefix === undefined) throw new EngineError('this stage runner keeps no prefixes')
        const layers = runner.exportPrefix(msg.key, msg.length)
        post({ type: 'exported', id: msg.id, length: msg.length, layers }, layers.map(t => t.buffer as ArrayBuffer))
        return
      }
      case 'import-prefix': {
        if (runner.importPrefix === undefined) throw new EngineError('this stage runner keeps no prefixes')
        post({ type: 'retained', id: msg.id, ...runner.importPrefix(msg.key, msg.length, msg.layers) })
        return
      }
      case 'ahead-picks':
        return // the scheduler's
      case 'evict':
        runner.evict?.(msg.keys)
        post({ type: 'done', id: msg.id })
        return
      case 'close':
        dumpStepTrace()
        await session.close()
        post({ type: 'done', id: msg.id })
        port.close()
    }
  } catch (err) {
    post({ type: 'error', id: msg.id, error: serializeError(err) })
  }
}

main(workerData as WorkerInit).catch((err: unknown) => {
  post({ type: 'init-error', error: serializeError(err) })
  port.close()
})
