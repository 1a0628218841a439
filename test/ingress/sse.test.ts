/**
 * openSse on a real HTTP server and a real socket: the headers leave with the first event in one
 * write (no write of their own before the first token), each event reaches the socket as it is
 * sent (not at the next tick, which a sender busy in microtasks delays), and the headers still
 * leave promptly when no event follows in the same turn (a first token whose text is held back).
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

  it('hands an event to the socket as it is sent, while the sender goes on in microtasks', async () => {
    let pendingAfterSend = -1
    const { url } = await serve(res => {
      const sse = openSse(res, {})
      void (async () => {
        await Promise.resolve() // from here on in microtasks, as a generation runs
        await sse.send({ n: 1 }, AbortSignal.timeout(5_000))
        // Still in this turn's microtasks (as a generation is, building its receipt): the event
        // must not wait in the response's buffer for the next tick.
        pendingAfterSend = res.writableLength
        await Promise.resolve()
        await sse.send({ n: 2 }, AbortSignal.timeout(5_000))
        sse.done()
      })()
    })
    const res = await get(url)
    let body = ''
    for await (const chunk of res) body += String(chunk)
    expect(body).toBe('data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n')
    expect(pendingAfterSend).toBe(0)
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
