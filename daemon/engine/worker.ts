/**
 * Engine worker entry: loads one stage graph on one backend/device and serves the protocol in
 * protocol.ts. `session.run` blocks the thread it runs on, which is why it runs here and not on
 * the daemon's event loop. Steps run one at a time in arrival order; open/free/cancel/stats are
 * answered between steps (the backend yields between chunks).
 */
import { parentPort, workerData } from 'node:worker_threads'
import { serializeError } from '../errors.ts'
import { loadBackend } from './backend/index.ts'
import type { BackendSession } from './backend/types.ts'
import { EngineError } from './errors.ts'
import { ENGINE_PROTOCOL_VERSION, ownBuffer, parseToWorker } from './protocol.ts'
import type { FromWorker, ToWorker, WorkerInit } from './protocol.ts'
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
  }
  let session: BackendSession
  let runner: StageRunner
  if (init.staticGraphs === undefined) {
    session = await backend.load(init.graphPath, options)
    runner = createStageRunner({ session, stage: init.stage, maxSequences: init.maxSequences, chunkSize: init.chunkSize })
  } else {
    const { prefill: prefillPath, decode: decodePath, contextLength, chunk } = init.staticGraphs
    const prefill = await backend.load(prefillPath, options)
    const decode = await backend.load(decodePath, options)
    session = { inputNames: prefill.inputNames, outputNames: prefill.outputNames, run: async (f) => await prefill.run(f), close: async () => { await prefill.close(); await decode.close() } }
    runner = createStaticStageRunner({ prefill, decode, stage: init.stage, maxSequences: init.maxSequences, contextLength, chunk })
  }
  let queue: Promise<void> = Promise.resolve()
  port.on('message', (raw: unknown) => {
    stepMark('w.recv')
    const msg = parseToWorker(raw)
    if (typeof msg === 'string') {
      const id = (raw as { id?: unknown } | null)?.id
      post({ type: 'error', id: typeof id === 'number' ? id : -1, error: serializeError(new EngineError(`malformed engine message: ${msg}`)) })
      return
    }
    if (msg.type === 'step' || msg.type === 'step-batch') {
      queue = queue.then(() => handle(msg, runner, session))
    } else {
      void handle(msg, runner, session)
    }
  })
  post({ type: 'ready', version: ENGINE_PROTOCOL_VERSION, inputNames: [...session.inputNames], outputNames: [...session.outputNames] })
}

async function handle (msg: ToWorker, runner: StageRunner, session: BackendSession): Promise<void> {
  try {
    switch (msg.type) {
      case 'open':
        runner.open(msg.seqId)
        post({ type: 'done', id: msg.id })
        return
      case 'step': {
        const output = await runner.step(msg.seqId, msg.input, msg.positions, msg.logitsToKeep, msg.pick)
        if (output.kind === 'token') {
          stepMark('w.post')
          post({ type: 'stepped', id: msg.id, output })
          return
        }
        const data = ownBuffer(output.data)
        post({ type: 'stepped', id: msg.id, output: { ...output, data } }, [data.buffer as ArrayBuffer])
        return
      }
      case 'step-batch': {
        const results = await runner.stepBatch(msg.items)
        const transfer = new Set<ArrayBuffer>()
        const wire = results.map(r => {
          if ('error' in r) return { error: serializeError(r.error) }
          if (r.output.kind === 'token') return r
          const data = ownBuffer(r.output.data)
          if (transfer.has(data.buffer as ArrayBuffer)) return { output: { ...r.output, data: data.slice() } }
          transfer.add(data.buffer as ArrayBuffer)
          return { output: { ...r.output, data } }
        })
        stepMark('w.post')
        post({ type: 'stepped-batch', id: msg.id, results: wire }, [...transfer])
        return
      }
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
