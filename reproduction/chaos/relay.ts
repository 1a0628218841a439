/**
 * A user-space relay in front of one node's libp2p port, for the faults this kernel's `tc` cannot
 * inject (no netem, no classifiers, no iptables): a fixed one-way delay and random UDP loss.
 *
 * UDP (QUIC) is relayed like a NAT: one upstream socket per client address, so the node sees each
 * client as its own flow, closed after `udpIdleMs` without traffic. TCP is relayed per
 * connection. The node announces the relay's address (`shoal node --announce`), so every peer's
 * connection to it runs through here.
 *
 * An impairment applies to the flows whose client address `applies` accepts (default: all), both
 * directions, checked per packet so it starts and ends on live connections: each datagram or
 * chunk waits `delayMs` in a FIFO delay line (order kept even when the delay changes: nothing is
 * released before what was queued ahead of it), and each UDP datagram is dropped with probability
 * `loss` (TCP is a byte stream; dropping a chunk would corrupt it, so TCP gets only the delay —
 * the loss TCP itself would see is what QUIC sees here). Queues are bounded: past `maxQueuedBytes`
 * a direction drops UDP datagrams (counted as overflow) and pauses the TCP socket feeding it.
 */
import { createSocket } from 'node:dgram'
import type { RemoteInfo, Socket as UdpSocket } from 'node:dgram'
import { createConnection, createServer } from 'node:net'
import type { Server, Socket } from 'node:net'

export interface Impairment {
  /** One-way delay added to every packet or chunk, each direction (ms). */
  delayMs: number
  /** Probability a UDP datagram is dropped, each direction (0–1). */
  loss: number
}

export interface RelayInit {
  /** Address the relay listens on (UDP and TCP, the same port number). */
  host: string
  /** 0: an ephemeral port (UDP and TCP may then differ). */
  port: number
  /** The node's real listen address. */
  target: { host: string, udpPort: number, tcpPort: number }
  udpIdleMs?: number
  /** Per direction of each flow; default 4 MiB. */
  maxQueuedBytes?: number
  /** At most this many UDP flows (client addresses) at once; datagrams of further ones are dropped. */
  maxUdpFlows?: number
  random?: () => number
}

export interface RelayStats {
  udpDatagrams: number
  udpBytes: number
  /** Dropped by the injected loss. */
  udpLost: number
  /** Dropped because a delay line was full or there were too many flows. */
  udpOverflow: number
  udpFlows: number
  tcpConnections: number
  tcpBytes: number
  /** Packets and chunks that went through an impairment (delayed, or considered for loss). */
  impaired: number
}

export interface Relay {
  udpPort: number
  tcpPort: number
  /** Impairs the flows whose client address `applies` accepts (all by default) until `clear`. */
  impair (impairment: Impairment, applies?: (clientAddress: string) => boolean): void
  clear (): void
  stats (): RelayStats
  close (): Promise<void>
}

/**
 * A FIFO of items each released `delayMs` after it was pushed but never before an item pushed
 * earlier, by one timer. `push` returns false (and queues nothing) past `maxBytes`.
 */
export class DelayLine<T> {
  private readonly queue: Array<{ due: number, item: T, size: number }> = []
  private head = 0
  private lastDue = 0
  private timer: NodeJS.Timeout | undefined
  bytes = 0

  private readonly deliver: (item: T) => void
  private readonly maxBytes: number
  private readonly onDrained: (() => void) | undefined

  constructor (deliver: (item: T) => void, maxBytes: number, onDrained?: () => void) {
    this.deliver = deliver
    this.maxBytes = maxBytes
    this.onDrained = onDrained
  }

  get length (): number { return this.queue.length - this.head }

  push (item: T, size: number, delayMs: number): boolean {
    const now = Date.now()
    if (delayMs <= 0 && this.length === 0) { this.deliver(item); return true }
    if (this.bytes + size > this.maxBytes) return false
    const due = Math.max(now + delayMs, this.lastDue)
    this.lastDue = due
    this.queue.push({ due, item, size })
    this.bytes += size
    this.schedule()
    return true
  }

  clear (): void {
    if (this.timer !== undefined) clearTimeout(this.timer)
    this.timer = undefined
    this.queue.length = 0
    this.head = 0
    this.bytes = 0
  }

  private schedule (): void {
    if (this.timer !== undefined || this.length === 0) return
    this.timer = setTimeout(() => { this.timer = undefined; this.release() }, Math.max(0, this.queue[this.head]!.due - Date.now()))
  }

  private release (): void {
    const now = Date.now()
    while (this.length > 0 && this.queue[this.head]!.due <= now) {
      const { item, size } = this.queue[this.head++]!
      this.bytes -= size
      this.deliver(item)
    }
    if (this.head > 1024 && this.head * 2 > this.queue.length) { this.queue.splice(0, this.head); this.head = 0 }
    if (this.length === 0) this.onDrained?.()
    this.schedule()
  }
}

interface UdpFlow {
  upstream: UdpSocket
  lastActive: number
  toNode: DelayLine<Buffer>
  toClient: DelayLine<Buffer>
}

export async function createRelay (init: RelayInit): Promise<Relay> {
  const maxQueued = init.maxQueuedBytes ?? 4 * 1024 * 1024
  const idleMs = init.udpIdleMs ?? 60_000
  const maxFlows = init.maxUdpFlows ?? 1024
  const random = init.random ?? Math.random
  const stats: RelayStats = { udpDatagrams: 0, udpBytes: 0, udpLost: 0, udpOverflow: 0, udpFlows: 0, tcpConnections: 0, tcpBytes: 0, impaired: 0 }
  let impairment: Impairment | undefined
  let applies: (clientAddress: string) => boolean = () => true
  const current = (client: string): Impairment | undefined => impairment !== undefined && applies(client) ? impairment : undefined

  // UDP: one upstream socket per client address.
  const server = createSocket('udp4')
  const flows = new Map<string, UdpFlow>()
  const closeFlow = (key: string, flow: UdpFlow): void => {
    flows.delete(key)
    flow.toNode.clear()
    flow.toClient.clear()
    try { flow.upstream.close() } catch {}
    stats.udpFlows = flows.size
  }
  /** Counts, drops (loss), then queues a datagram; the delay line sends it. */
  const relayDatagram = (line: DelayLine<Buffer>, msg: Buffer, client: string): void => {
    stats.udpDatagrams++
    stats.udpBytes += msg.length
    const i = current(client)
    if (i !== undefined) {
      stats.impaired++
      if (i.loss > 0 && random() < i.loss) { stats.udpLost++; return }
    }
    if (!line.push(msg, msg.length, i?.delayMs ?? 0)) stats.udpOverflow++
  }
  const flowFor = (rinfo: RemoteInfo): UdpFlow | undefined => {
    const key = `${rinfo.address}:${rinfo.port}`
    const existing = flows.get(key)
    if (existing !== undefined) return existing
    if (flows.size >= maxFlows) return undefined
    const upstream = createSocket('udp4')
    const flow: UdpFlow = {
      upstream,
      lastActive: Date.now(),
      toNode: new DelayLine(msg => { upstream.send(msg, init.target.udpPort, init.target.host, () => {}) }, maxQueued),
      toClient: new DelayLine(msg => { server.send(msg, rinfo.port, rinfo.address, () => {}) }, maxQueued),
    }
    upstream.on('error', () => { closeFlow(key, flow) })
    upstream.on('message', (msg, from) => {
      if (from.address !== init.target.host || from.port !== init.target.udpPort) return
      flow.lastActive = Date.now()
      relayDatagram(flow.toClient, msg, rinfo.address)
    })
    upstream.bind(0)
    flows.set(key, flow)
    stats.udpFlows = flows.size
    return flow
  }
  server.on('message', (msg, rinfo) => {
    const flow = flowFor(rinfo)
    if (flow === undefined) { stats.udpOverflow++; return }
    flow.lastActive = Date.now()
    relayDatagram(flow.toNode, msg, rinfo.address)
  })
  server.on('error', () => {})
  await new Promise<void>((resolve, reject) => { server.once('error', reject); server.bind(init.port, init.host, () => { server.off('error', reject); resolve() }) })
  const udpPort = server.address().port
  const sweep = setInterval(() => {
    const now = Date.now()
    for (const [key, flow] of flows) if (now - flow.lastActive > idleMs) closeFlow(key, flow)
  }, Math.max(100, Math.min(idleMs / 4, 5_000)))
  sweep.unref()

  // TCP: one upstream connection per client connection.
  const sockets = new Set<Socket>()
  const pipe = (from: Socket, to: Socket, client: string): void => {
    let lineFull = false
    let sinkFull = false
    const maybeResume = (): void => { if (!lineFull && !sinkFull && !from.destroyed) from.resume() }
    // null: the end of the stream, which travels behind the data queued ahead of it.
    const line = new DelayLine<Buffer | null>(chunk => {
      if (to.destroyed) return
      if (chunk === null) { to.end(); return }
      if (!to.write(chunk)) {
        sinkFull = true
        from.pause()
        to.once('drain', () => { sinkFull = false; maybeResume() })
      }
    }, Infinity, () => { lineFull = false; maybeResume() })
    from.on('data', (chunk: Buffer) => {
      stats.tcpBytes += chunk.length
      const i = current(client)
      if (i !== undefined) stats.impaired++
      line.push(chunk, chunk.length, i?.delayMs ?? 0)
      // Bounded by backpressure: at most one chunk past the bound is queued.
      if (line.bytes > maxQueued) { lineFull = true; from.pause() }
    })
    let ended = false
    from.on('end', () => { ended = true; line.push(null, 0, current(client)?.delayMs ?? 0) })
    // A clean end drains through the line; a reset or error cuts the other side at once.
    from.on('close', () => { if (!ended) { line.clear(); if (!to.destroyed) to.destroy() } })
  }
  const tcp: Server = createServer({ pauseOnConnect: false }, client => {
    stats.tcpConnections++
    const clientAddress = client.remoteAddress?.replace(/^::ffff:/, '') ?? ''
    const upstream = createConnection({ host: init.target.host, port: init.target.tcpPort })
    for (const s of [client, upstream]) {
      sockets.add(s)
      s.on('error', () => {})
      s.on('close', () => { sockets.delete(s) })
    }
    pipe(client, upstream, clientAddress)
    pipe(upstream, client, clientAddress)
  })
  await new Promise<void>((resolve, reject) => { tcp.once('error', reject); tcp.listen(init.port === 0 ? 0 : init.port, init.host, () => { tcp.off('error', reject); resolve() }) })
  const tcpAddress = tcp.address()
  if (tcpAddress === null || typeof tcpAddress === 'string') throw new Error('relay: no TCP address')

  return {
    udpPort,
    tcpPort: tcpAddress.port,
    impair: (i, which) => {
      if (!(i.delayMs >= 0) || !(i.loss >= 0 && i.loss <= 1)) throw new RangeError(`relay: impairment out of range: ${JSON.stringify(i)}`)
      impairment = { ...i }
      applies = which ?? (() => true)
    },
    clear: () => { impairment = undefined; applies = () => true },
    stats: () => ({ ...stats }),
    close: async () => {
      clearInterval(sweep)
      for (const [key, flow] of flows) closeFlow(key, flow)
      for (const s of sockets) s.destroy()
      await new Promise<void>(resolve => { server.close(() => { resolve() }) })
      await new Promise<void>(resolve => { tcp.close(() => { resolve() }) })
    },
  }
}
