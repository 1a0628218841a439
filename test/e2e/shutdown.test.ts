/**
 * Stopping the daemon while a client holds a connection open. Completions are drained by the
 * ingress; a connection that carries no request must not keep `shoal serve` from exiting.
 */
import { connect } from 'node:net'
import type { Socket } from 'node:net'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { makeTinyCheckpoint, startDaemon } from './daemon.ts'
import type { RunningDaemon, TinyCheckpoint } from './daemon.ts'

let ck: TinyCheckpoint
let d: RunningDaemon
let socket: Socket | undefined

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: true })
  d = await startDaemon(ck.shardDir, ck.root)
})
afterAll(async () => {
  socket?.destroy()
  await d?.stop()
  await ck?.cleanup()
})

describe('daemon stop', () => {
  // A connection that never sent a request (a browser preconnect, an HTTP client's spare pooled
  // socket) must not hold stop() — and Ctrl-C of `shoal serve` — until the client hangs up.
  it('finishes while a client holds an idle connection that sent no request', async () => {
    const { port, hostname } = new URL(d.url)
    socket = connect(Number(port), hostname)
    await new Promise<void>((resolve, reject) => { socket!.once('connect', resolve); socket!.once('error', reject) })
    const stopped = d.stop().then(() => true)
    // Stopping an idle daemon takes milliseconds; 3 s is a deadline, not a measurement.
    const deadline = new Promise<boolean>(resolve => setTimeout(() => resolve(false), 3_000))
    expect(await Promise.race([stopped, deadline])).toBe(true)
  })
})
