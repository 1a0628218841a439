/**
 * onnxruntime sessions that run on a worker thread: the same `run(feeds) → outputs` shape as an
 * `ort.InferenceSession`, for code that drives graphs directly (the MoE stage's attention graphs
 * and an expert holder's experts) rather than through a stage engine. onnxruntime-node's `run`
 * computes on the calling thread (its promise only defers the start), so on the main thread a run
 * stops the HTTP server, the mesh's heartbeats and every other stream for its whole duration.
 * One worker per `OffThreadSessions`, its sessions' runs one after another, as they ran before.
 * Feeds are copied into fresh buffers and transferred (a caller's arrays stay intact); outputs come
 * back transferred.
 */
import { Worker } from 'node:worker_threads'
import * as ort from 'onnxruntime-node'
import { EngineError, ShuttingDownError } from './errors.ts'

export interface WireTensor {
  name: string
  type: 'float32' | 'int64' | 'int32'
  data: Float32Array | BigInt64Array | Int32Array
  dims: number[]
}

export type HostMessage =
  | { type: 'load', id: number, path: string, threads: number, kernels?: string }
  | { type: 'run', id: number, handle: number, feeds: WireTensor[] }
  | { type: 'release', id: number, handle: number }
  /** `runs` runs of the same feeds, each timed on the worker (kernel-probe.ts): no copies between them. */
  | { type: 'time', id: number, handle: number, feeds: WireTensor[], runs: number }

export type HostReply =
  | { id: number, error: string }
  | { id: number, handle: number, inputNames: string[], outputNames: string[], threadId: number }
  | { id: number, outputs: WireTensor[] }
  | { id: number, ms: number[] }
  | { id: number }

export interface OffThreadSession {
  readonly inputNames: readonly string[]
  readonly outputNames: readonly string[]
  /** The worker thread that runs it (never the caller's). */
  readonly threadId: number
  run (feeds: Record<string, ort.Tensor>): Promise<Record<string, ort.Tensor>>
  /** Runs the same feeds `runs` times on the worker; each run's milliseconds, outputs dropped. */
  time (feeds: Record<string, ort.Tensor>, runs: number): Promise<number[]>
  release (): Promise<void>
}

export interface OffThreadSessions {
  /** Loads a graph on the worker (started on first use); `kernels` as LoadOptions.kernels. */
  create (graphPath: string, options?: { threads?: number, kernels?: string }): Promise<OffThreadSession>
  /** Ends the worker; pending calls fail with ShuttingDownError. */
  close (): Promise<void>
}

export function createOffThreadSessions (): OffThreadSessions {
  let worker: Worker | undefined
  let nextId = 1
  const pending = new Map<number, { resolve: (r: HostReply) => void, reject: (e: Error) => void }>()

  const failAll = (err: Error): void => {
    for (const p of pending.values()) p.reject(err)
    pending.clear()
    worker = undefined
  }

  function started (): Worker {
    if (worker !== undefined) return worker
    const w = new Worker(new URL('./session-host.ts', import.meta.url))
    // Idle, it must not keep the process alive; while a call is in flight it does (call()).
    w.unref()
    w.on('message', (r: HostReply) => {
      const p = pending.get(r.id)
      if (p === undefined) return
      pending.delete(r.id)
      if (pending.size === 0) w.unref()
      if ('error' in r) p.reject(new EngineError(r.error))
      else p.resolve(r)
    })
    w.on('error', err => { failAll(new EngineError(`session worker crashed: ${err.message}`, { cause: err })) })
    w.on('exit', code => { if (worker === w) failAll(new ShuttingDownError(`session worker exited (code ${code})`)) })
    worker = w
    return w
  }

  async function call (m: HostMessage, transfer: ArrayBuffer[] = []): Promise<HostReply> {
    const w = started()
    return await new Promise<HostReply>((resolve, reject) => {
      if (pending.size === 0) w.ref()
      pending.set(m.id, { resolve, reject })
      w.postMessage(m, transfer)
    })
  }

  return {
    async create (graphPath, options = {}) {
      const r = await call({ type: 'load', id: nextId++, path: graphPath, threads: options.threads ?? 1, ...(options.kernels === undefined ? {} : { kernels: options.kernels }) })
      if (!('handle' in r)) throw new EngineError(`session worker answered a load of ${graphPath} with no session`)
      const handle = r.handle
      return {
        inputNames: r.inputNames,
        outputNames: r.outputNames,
        threadId: r.threadId,
        async run (feeds) {
          const { wire, transfer } = toWire(feeds)
          const reply = await call({ type: 'run', id: nextId++, handle, feeds: wire }, transfer)
          if (!('outputs' in reply)) throw new EngineError('session worker answered a run with no outputs')
          const out: Record<string, ort.Tensor> = {}
          for (const o of reply.outputs) out[o.name] = new ort.Tensor(o.type, o.data, o.dims)
          return out
        },
        async time (feeds, runs) {
          const { wire, transfer } = toWire(feeds)
          const reply = await call({ type: 'time', id: nextId++, handle, feeds: wire, runs }, transfer)
          if (!('ms' in reply)) throw new EngineError('session worker answered a timing with no times')
          return reply.ms
        },
        async release () {
          if (worker === undefined) return
          await call({ type: 'release', id: nextId++, handle })
        },
      }
    },
    async close () {
      const w = worker
      worker = undefined
      if (w === undefined) return
      failAll(new ShuttingDownError('session worker closed'))
      await w.terminate()
    },
  }
}

/** Feeds as wire tensors, each a copy owning its buffer (transferred): the caller's arrays (often views of a frame) stay usable. */
function toWire (feeds: Record<string, ort.Tensor>): { wire: WireTensor[], transfer: ArrayBuffer[] } {
  const wire: WireTensor[] = []
  const transfer: ArrayBuffer[] = []
  for (const [name, t] of Object.entries(feeds)) {
    const data = (t.data as Float32Array | BigInt64Array | Int32Array).slice()
    wire.push({ name, type: t.type as WireTensor['type'], data, dims: [...t.dims] })
    transfer.push(data.buffer as ArrayBuffer)
  }
  return { wire, transfer }
}
