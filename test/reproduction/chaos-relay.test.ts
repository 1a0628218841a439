/**
 * The chaos suite's lossy relay (reproduction/chaos/relay.ts) on real loopback sockets: UDP
 * datagrams and a TCP stream reach the target and come back, an impairment delays them at least
 * its one-way delay each way and drops about its share of UDP datagrams, only for the clients it
 * applies to, and a TCP stream keeps its bytes and their order while the delay changes under it.
 * Only lower bounds on time (the machine is shared); loss within generous bounds.
 */
import { createSocket } from 'node:dgram'
import type { Socket as UdpSocket } from 'node:dgram'
import { createConnection, createServer } from 'node:net'
import type { Server } from 'node:net'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { DelayLine, createRelay } from '../../reproduction/chaos/relay.ts'
import type { Relay } from '../../reproduction/chaos/relay.ts'

const sleep = async (ms: number): Promise<void> => { await new Promise(resolve => setTimeout(resolve, ms)) }

describe('DelayLine', () => {
  it('releases in push order even when a later item has a shorter delay, and refuses past its bound', async () => {
    const out: number[] = []
    const line = new DelayLine<number>(x => { out.push(x) }, 10)
    expect(line.push(1, 4, 60)).toBe(true)
    expect(line.push(2, 4, 0)).toBe(true)
    expect(line.push(3, 4, 0)).toBe(false)
    await sleep(30)
    expect(out).toEqual([])
    await sleep(100)
    expect(out).toEqual([1, 2])
    line.push(4, 1, 0)
    expect(out).toEqual([1, 2, 4])
  })
})

describe('relay on loopback', () => {
  let echoUdp: UdpSocket
  let echoTcp: Server
  let relay: Relay
  const clients: UdpSocket[] = []

  beforeAll(async () => {
    echoUdp = createSocket('udp4')
    echoUdp.on('message', (msg, r) => { echoUdp.send(msg, r.port, r.address) })
    await new Promise<void>(resolve => { echoUdp.bind(0, '127.0.0.1', resolve) })
    echoTcp = createServer(s => { s.pipe(s) })
    await new Promise<void>(resolve => { echoTcp.listen(0, '127.0.0.1', resolve) })
    const tcpPort = (echoTcp.address() as { port: number }).port
    relay = await createRelay({ host: '127.0.0.1', port: 0, target: { host: '127.0.0.1', udpPort: echoUdp.address().port, tcpPort }, udpIdleMs: 1_000 })
  })

  afterAll(async () => {
    for (const c of clients) c.close()
    await relay.close()
    echoUdp.close()
    await new Promise<void>(resolve => { echoTcp.close(() => { resolve() }) })
  })

  /**
   * Sends `n` numbered datagrams through the relay; resolves with those echoed and the first round
   * trip, once none has arrived for `waitMs` (at most 10 s): a loaded machine's late delay timers
   * must not count as loss.
   */
  async function udpRound (n: number, waitMs: number): Promise<{ got: Set<number>, firstRttMs: number }> {
    const c = createSocket('udp4')
    clients.push(c)
    await new Promise<void>(resolve => { c.bind(0, '127.0.0.1', resolve) })
    const got = new Set<number>()
    const sent = new Map<number, number>()
    let firstRttMs = Infinity
    let lastAt = Date.now()
    c.on('message', msg => {
      const i = msg.readUInt32BE(0)
      lastAt = Date.now()
      got.add(i)
      firstRttMs = Math.min(firstRttMs, Date.now() - sent.get(i)!)
    })
    for (let i = 0; i < n; i++) {
      const b = Buffer.alloc(64)
      b.writeUInt32BE(i, 0)
      sent.set(i, Date.now())
      c.send(b, relay.udpPort, '127.0.0.1')
      // Paced, so socket buffers on the way (not the relay) never drop a burst.
      if (i % 10 === 9) await sleep(1)
    }
    const started = Date.now()
    lastAt = Date.now()
    while (Date.now() - lastAt < waitMs && Date.now() - started < 10_000) await sleep(20)
    return { got, firstRttMs }
  }

  it('relays UDP untouched without an impairment', async () => {
    const { got } = await udpRound(200, 300)
    expect(got.size).toBeGreaterThanOrEqual(195)
    expect(relay.stats().udpLost).toBe(0)
  })

  it('drops about the loss share each way and delays each way', async () => {
    relay.impair({ delayMs: 50, loss: 0.1 })
    const before = relay.stats()
    const { got, firstRttMs } = await udpRound(1000, 800)
    relay.clear()
    // Both ways at 10 %: about 81 % come back.
    expect(got.size).toBeGreaterThan(650)
    expect(got.size).toBeLessThan(950)
    expect(firstRttMs).toBeGreaterThanOrEqual(95)
    expect(relay.stats().udpLost - before.udpLost).toBeGreaterThan(80)
  })

  it('impairs only the clients it applies to', async () => {
    relay.impair({ delayMs: 0, loss: 1 }, address => address === '10.0.0.1')
    const { got } = await udpRound(100, 300)
    relay.clear()
    expect(got.size).toBeGreaterThanOrEqual(95)
  })

  it('keeps a TCP stream whole and in order while the delay changes under it, each chunk at least the delay late', async () => {
    const sock = createConnection({ host: '127.0.0.1', port: relay.tcpPort })
    await new Promise<void>(resolve => sock.once('connect', () => { resolve() }))
    const received: Buffer[] = []
    relay.impair({ delayMs: 40, loss: 0.5 })
    const t0 = Date.now()
    let firstAt = 0
    sock.on('data', b => { if (received.length === 0) firstAt = Date.now() - t0; received.push(b) })
    const expected: Buffer[] = []
    for (let i = 0; i < 40; i++) {
      const b = Buffer.alloc(1000, i)
      expected.push(b)
      sock.write(b)
      if (i === 20) relay.impair({ delayMs: 0, loss: 0 })
      if (i % 5 === 0) await sleep(3)
    }
    relay.clear()
    while (Buffer.concat(received).length < 40_000) await sleep(10)
    expect(Buffer.concat(received).equals(Buffer.concat(expected))).toBe(true)
    // 40 ms on the way out (the way back may already be undelayed); TCP ignores the loss.
    expect(firstAt).toBeGreaterThanOrEqual(39)
    sock.destroy()
  })

  it('closes idle UDP flows', async () => {
    await udpRound(1, 100)
    expect(relay.stats().udpFlows).toBeGreaterThan(0)
    await sleep(1_800)
    expect(relay.stats().udpFlows).toBe(0)
  })
})
