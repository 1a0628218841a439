/**
 * The JSON body parser. Small bodies (nearly all) are parsed inline by fastify's own parser; a
 * body over OFFLOAD_JSON_ABOVE_BYTES is decoded and parsed in a worker thread, so one client
 * sending megabytes does not stall every other request, /healthz included. Both refuse the same
 * inputs with the same fastify error codes (fromFastifyError turns them into OpenAI's shape).
 */
import { Worker } from 'node:worker_threads'
import type { FastifyInstance } from 'fastify'

/** Parsing 256 KiB of JSON takes a few ms; above it, the worker's round trip is worth it. */
export const OFFLOAD_JSON_ABOVE_BYTES = 256 * 1024

export interface JsonRequest { id: number, bytes: Uint8Array }
export type JsonReply = { id: number, value: unknown } | { id: number, error: 'invalid' | 'poisoned' | 'too-deep' }

/** A framework-coded error, as fastify's parser would give (see fromFastifyError). */
function codedError (code: string, message: string, statusCode: number): Error {
  return Object.assign(new Error(message), { code, statusCode })
}

export interface JsonParserThread {
  parse (bytes: Buffer): Promise<unknown>
  close (): Promise<void>
}

function createJsonParserThread (): JsonParserThread {
  let worker: Worker | undefined
  let nextId = 1
  const pending = new Map<number, { resolve: (v: unknown) => void, reject: (e: Error) => void }>()
  const failAll = (err: Error): void => {
    for (const p of pending.values()) p.reject(err)
    pending.clear()
  }
  const start = (): Worker => {
    const w = new Worker(new URL('./json-worker.ts', import.meta.url))
    w.unref()
    w.on('message', (reply: JsonReply) => {
      const p = pending.get(reply.id)
      if (p === undefined) return
      pending.delete(reply.id)
      if ('value' in reply) p.resolve(reply.value)
      else if (reply.error === 'too-deep') p.reject(codedError('SHOAL_ERR_BAD_REQUEST', 'Request body is nested too deeply', 400))
      else p.reject(codedError('FST_ERR_CTP_INVALID_JSON_BODY', reply.error === 'poisoned' ? 'Object contains forbidden prototype property' : 'Body is not valid JSON', 400))
    })
    w.on('error', (err) => { if (worker === w) worker = undefined; failAll(err) })
    w.on('exit', () => { if (worker === w) worker = undefined; failAll(new Error('the JSON parser worker exited')) })
    return w
  }
  return {
    async parse (bytes) {
      worker ??= start()
      const w = worker
      const id = nextId++
      // The worker takes the bytes over; a Buffer that shares a pooled ArrayBuffer is copied first.
      const whole = bytes.byteOffset === 0 && bytes.byteLength === bytes.buffer.byteLength && bytes.buffer instanceof ArrayBuffer
      const own = whole ? new Uint8Array(bytes.buffer) : new Uint8Array(bytes)
      return await new Promise((resolve, reject) => {
        pending.set(id, { resolve, reject })
        w.postMessage({ id, bytes: own } satisfies JsonRequest, [own.buffer])
      })
    },
    async close () {
      const w = worker
      worker = undefined
      failAll(new Error('the JSON parser is closed'))
      if (w !== undefined) await w.terminate()
    },
  }
}

/** Replaces fastify's application/json parser with one that parses large bodies off the event loop. */
export function registerJsonParser (app: FastifyInstance): JsonParserThread {
  const inline = app.getDefaultJsonParser('error', 'error')
  const thread = createJsonParserThread()
  app.removeContentTypeParser('application/json')
  app.addContentTypeParser('application/json', { parseAs: 'buffer' }, (request, body, done) => {
    const bytes = body as Buffer
    if (bytes.length <= OFFLOAD_JSON_ABOVE_BYTES) {
      inline(request, bytes.toString('utf8'), done)
      return
    }
    thread.parse(bytes).then(value => { done(null, value) }, (err: Error) => { done(err, undefined) })
  })
  return thread
}
