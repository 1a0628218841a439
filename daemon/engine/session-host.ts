/**
 * The worker side of off-thread sessions (off-thread-sessions.ts): onnxruntime sessions created
 * and run on this thread, so a caller's event loop is never blocked by a run (onnxruntime-node's
 * `run` computes on the thread that calls it). Each message names its request id; outputs travel
 * back transferred, never copied twice.
 */
import { parentPort, threadId } from 'node:worker_threads'
import * as ort from 'onnxruntime-node'
import { createOrtSession } from './backend/onnxruntime.ts'
import type { HostMessage, HostReply, WireTensor } from './off-thread-sessions.ts'

const port = parentPort!
const sessions = new Map<number, ort.InferenceSession>()
let nextHandle = 1

const post = (reply: HostReply, transfer: ArrayBuffer[] = []): void => { port.postMessage(reply, transfer) }

/** A tensor's data as an array owning its buffer (a view of a larger one is copied out). */
function owned (data: ort.Tensor['data']): WireTensor['data'] {
  const d = data as Float32Array | BigInt64Array | Int32Array
  return d.byteOffset === 0 && d.byteLength === d.buffer.byteLength ? d : d.slice()
}

/** The session a run or timing names, and its feeds as onnxruntime tensors over the wire arrays. */
function sessionAndFeeds (m: Extract<HostMessage, { type: 'run' | 'time' }>): { s: ort.InferenceSession, feeds: Record<string, ort.Tensor> } {
  const s = sessions.get(m.handle)
  if (s === undefined) throw new Error(`no session ${m.handle} on this worker`)
  const feeds: Record<string, ort.Tensor> = {}
  for (const t of m.feeds) feeds[t.name] = new ort.Tensor(t.type, t.data, t.dims)
  return { s, feeds }
}

async function handle (m: HostMessage): Promise<void> {
  try {
    switch (m.type) {
      case 'load': {
        // onnxruntime's default lets intra-op threads spin between runs, taking the cores from
        // the engine's sessions in the same process; these spin only within a run, as those do.
        const s = await createOrtSession(m.path, { threads: m.threads, ...(m.kernels === undefined ? {} : { kernels: m.kernels }) })
        const h = nextHandle++
        sessions.set(h, s)
        post({ id: m.id, handle: h, inputNames: [...s.inputNames], outputNames: [...s.outputNames], threadId })
        return
      }
      case 'run': {
        const { s, feeds } = sessionAndFeeds(m)
        const out = await s.run(feeds)
        const outputs: WireTensor[] = []
        const transfer = new Set<ArrayBuffer>()
        for (const [name, v] of Object.entries(out)) {
          const t = v as ort.Tensor
          const data = owned(t.data)
          // Two outputs on one buffer cannot both be transferred: the second is copied.
          const buf = data.buffer as ArrayBuffer
          const d = transfer.has(buf) ? data.slice() : data
          transfer.add(d.buffer as ArrayBuffer)
          outputs.push({ name, type: t.type as WireTensor['type'], data: d, dims: [...t.dims] })
        }
        post({ id: m.id, outputs }, [...transfer])
        return
      }
      case 'time': {
        const { s, feeds } = sessionAndFeeds(m)
        const ms: number[] = []
        for (let i = 0; i < m.runs; i++) {
          const t0 = performance.now()
          await s.run(feeds)
          ms.push(performance.now() - t0)
        }
        post({ id: m.id, ms })
        return
      }
      case 'release': {
        await sessions.get(m.handle)?.release()
        sessions.delete(m.handle)
        post({ id: m.id })
      }
    }
  } catch (err) {
    post({ id: m.id, error: err instanceof Error ? err.message : String(err) })
  }
}

port.on('message', (m: HostMessage) => { void handle(m) })
