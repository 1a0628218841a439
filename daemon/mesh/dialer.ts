/**
 * Keeps the mesh connected: dials bootstrap multiaddrs at start and redials them with backoff
 * while not connected; dials peers found by mDNS; dials peers whose valid capability record
 * arrived by gossip (their addresses are in it) and admitted peers whose connection dropped.
 * Peers in refusal cooldown are kept out by the connection gater, not here.
 */
import { multiaddr } from '@multiformats/multiaddr'
import type { Multiaddr } from '@multiformats/multiaddr'
import type { PeerInfo } from '@libp2p/interface'
import { backoffDelay, firstDialDelay } from './decisions.ts'
import type { MeshLibp2p } from './libp2p-node.ts'
import type { MeshLogger, MeshTimings } from './types.ts'
import { MeshConfigError } from './errors.ts'

const DIAL_TIMEOUT_MS = 10_000
const TICK_MS = 500

interface Target {
  addrs: Multiaddr[]
  peerId?: string
  attempt: number
  nextAt: number
  dialling: boolean
  /** Bootstrap targets are kept forever; learned ones until `forget`, or until `until` after `release`. */
  bootstrap: boolean
  until?: number
}

export class Dialer {
  private libp2p: MeshLibp2p | undefined
  private readonly timings: MeshTimings
  private readonly log: MeshLogger
  private readonly targets = new Map<string, Target>()
  private timer: ReturnType<typeof setInterval> | undefined
  private readonly controller = new AbortController()

  constructor (bootstrap: string[], timings: MeshTimings, log: MeshLogger) {
    this.timings = timings
    this.log = log
    bootstrap.forEach((text, i) => {
      let ma: Multiaddr
      try {
        ma = multiaddr(text)
      } catch {
        throw new MeshConfigError(`bootstrap[${i}]`, `not a multiaddr: ${text}`)
      }
      this.targets.set(`bootstrap:${text}`, { addrs: [ma], peerId: ma.getComponents().find(c => c.name === 'p2p')?.value, attempt: 0, nextAt: 0, dialling: false, bootstrap: true })
    })
  }

  start (libp2p: MeshLibp2p): void {
    this.libp2p = libp2p
    libp2p.addEventListener('peer:discovery', this.onDiscovery)
    this.timer = setInterval(() => { this.tick() }, TICK_MS)
    this.tick()
  }

  stop (): void {
    this.controller.abort()
    if (this.timer !== undefined) clearInterval(this.timer)
    this.libp2p?.removeEventListener('peer:discovery', this.onDiscovery)
  }

  /** A peer to stay connected to (from a verified record): dialled now and redialled with backoff. */
  want (peerId: string, addrs: string[]): void {
    if (peerId === this.libp2p?.peerId.toString()) return
    const parsed: Multiaddr[] = []
    for (const a of addrs) {
      try {
        const ma = multiaddr(a)
        parsed.push(ma.getComponents().some(c => c.name === 'p2p') ? ma : ma.encapsulate(`/p2p/${peerId}`))
      } catch {}
    }
    if (parsed.length === 0) return
    const existing = this.targets.get(peerId)
    if (existing !== undefined) {
      existing.addrs = parsed
      delete existing.until
      return
    }
    const delay = firstDialDelay(this.libp2p?.peerId.toString() ?? '', peerId, 2 * this.timings.redialBaseMs)
    this.targets.set(peerId, { addrs: parsed, peerId, attempt: 0, nextAt: Date.now() + delay, dialling: false, bootstrap: false })
    if (delay === 0) this.tick()
  }

  /** The peer is admitted: its next redial, if ever needed, starts from the base delay. */
  admitted (peerId: string): void {
    for (const t of this.targets.values()) {
      if (t.peerId !== peerId) continue
      t.attempt = 0
      delete t.until
    }
  }

  forget (peerId: string): void {
    const t = this.targets.get(peerId)
    if (t !== undefined && !t.bootstrap) this.targets.delete(peerId)
  }

  /**
   * The peer was given up (silent too long): keep dialling it, from now and with backoff, for
   * `keepMs`, then forget it. A node restarted from the same identity comes back at the same
   * addresses; it may bootstrap only to others, and until its new records reach us through them
   * (if ever: the relays' gossip state may still point at its dead instance) we would never meet
   * it again. The chaos suite found a restarted pipeline stage cut off from its next stages so.
   */
  release (peerId: string, keepMs: number): void {
    const t = this.targets.get(peerId)
    if (t === undefined || t.bootstrap) return
    t.until = Date.now() + keepMs
    t.attempt = 0
    t.nextAt = Date.now()
  }

  private readonly onDiscovery = (evt: CustomEvent<PeerInfo>): void => {
    const { id, multiaddrs } = evt.detail
    this.want(id.toString(), multiaddrs.map(m => m.toString()))
  }

  private connected (peerId: string | undefined): boolean {
    if (peerId === undefined || this.libp2p === undefined) return false
    return this.libp2p.getConnections().some(c => c.remotePeer.toString() === peerId && c.status === 'open')
  }

  private tick (): void {
    const now = Date.now()
    for (const [key, target] of this.targets) {
      if (target.until !== undefined && now > target.until && !target.dialling) {
        this.targets.delete(key)
        continue
      }
      if (target.dialling || now < target.nextAt) continue
      if (this.connected(target.peerId)) continue
      this.dial(target)
    }
  }

  private dial (target: Target): void {
    const libp2p = this.libp2p
    if (libp2p === undefined || this.controller.signal.aborted) return
    target.dialling = true
    const signal = AbortSignal.any([this.controller.signal, AbortSignal.timeout(DIAL_TIMEOUT_MS)])
    libp2p.dial(target.addrs.length === 1 ? target.addrs[0] as Multiaddr : target.addrs, { signal })
      .then(connection => {
        target.peerId = connection.remotePeer.toString()
        // Backoff resets only on admission (`admitted`): a connection that then fails its
        // handshake counts as a failed attempt, so an overloaded peer is not redialled in a loop.
        target.nextAt = Date.now() + backoffDelay(target.attempt++, this.timings.redialBaseMs, this.timings.redialMaxMs, Math.random())
      })
      .catch(err => {
        target.nextAt = Date.now() + backoffDelay(target.attempt++, this.timings.redialBaseMs, this.timings.redialMaxMs, Math.random())
        this.log.debug({ addrs: target.addrs.map(String), err: String(err) }, 'mesh: dial failed')
      })
      .finally(() => { target.dialling = false })
  }
}
