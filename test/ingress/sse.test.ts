/**
 * openSse on a real HTTP server and a real socket: the headers leave with the first event in one
 * write (no write of their own before the first token), and still leave promptly when no event
 * follows in the same turn (a first token whose text is held back).
 */
import { createServer, request } from 'node:http'
import type { IncomingMessage, Server, ServerResponse } from 'node:http'
import type { AddressInfo, Socket } from 'node:net'
import { afterEach, describe, expect, it } from 'vitest'
import { openSse } from '../../daemon/ingress/sse.ts'

let server: Server | undefined
afterEach(async () => { await new Promise<void>(resolve => { if (server === undefined) resolve(); else server.close(() => { resolve() }) }) })

/** A server whose one response is handed to `handle`; counts the socket writes the response makes. */
async function serve (handle: (res: ServerResponse) => void): Promise<{ url: string, writes: () => number }> {
  let writes = 0
  server = createServer((_req, res) => {
    const socket = res.socket as Socket
    const count = <F extends (...args: never[]) => unknown>(f: F): F => ((...args: never[]) => { writes++; return f(...args) }) as F
    // Every write of a response reaches the socket through _writeGeneric (one write or writev syscall).
    const s = socket as unknown as { _writeGeneric: (...args: never[]) => unknown }
    s._writeGeneric = count(s._writeGeneric.bind(socket))
    handle(res)
  })
  await new Promise<void>(resolve => server!.listen(0, '127.0.0.1', resolve))
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/`, writes: () => writes }
}

function get (url: string): Promise<IncomingMessage> {
  return new Promise((resolve, reject) => { request(url, resolve).on('error', reject).end() })
}

describe('openSse', () => {
  it('sends the headers with the first event, in one write', async () => {
    const { url, writes } = await serve(res => {
      const sse = openSse(res, { 'x-test': '1' })
      void sse.send({ n: 1 }, AbortSignal.timeout(5_000)).then(() => { sse.done() })
    })
    const res = await get(url)
    expect(res.headers['content-type']).toBe('text/event-stream; charset=utf-8')
    expect(res.headers['x-test']).toBe('1')
    let body = ''
    for await (const chunk of res) body += String(chunk)
    expect(body).toBe('data: {"n":1}\n\ndata: [DONE]\n\n')
    // The headers and the first event in one write; the end ([DONE]) in another.
    expect(writes()).toBe(2)
  })

  it('sends the headers at the next turn when no event comes in this one', async () => {
    let sse: ReturnType<typeof openSse> | undefined
    const { url } = await serve(res => { sse = openSse(res, {}) })
    const res = await get(url) // resolves on the headers: nothing has been sent yet
    expect(res.statusCode).toBe(200)
    expect(res.headers['x-accel-buffering']).toBe('no')
    sse!.done()
    let body = ''
    for await (const chunk of res) body += String(chunk)
    expect(body).toBe('data: [DONE]\n\n')
  })
})
