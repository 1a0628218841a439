/**
 * Live load over `/shoal/load/1.0.0`. For every admitted peer one poller keeps a stream open and
 * asks for the peer's load every `loadIntervalMs` (one request in flight, so the cost is bounded);
 * each answer updates the peer table's load, RTT and last-seen time, from which liveness follows.
 * The serving side answers from `setLoadProvider` (told who asks, so it can say how much of the
 * load is the asker's own) and refuses requests faster than it allows.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import type { Connection, Stream } from '@libp2p/interface'
import { lengthPrefixed } from './lp-stream.ts'
import type { LengthPrefixed } from './lp-stream.ts'
import { WireError } from './errors.ts'
import type { MeshMetrics } from './metrics.ts'
import type { PeerTable } from './peer-table.ts'
import type { MeshLogger, MeshTimings } from './types.ts'
import { errorFrame } from './wire/frame.ts'
import { IDLE_LOAD, LOAD_MAX_FRAME, LOAD_PROTOCOL, decodeLoadFrame, encodeLoadFrame, parseLoadRecord } from './wire/load.ts'
import type { LoadFrame, LoadRecord } from './wire/load.ts'

export interface LoadDeps {
  peers: PeerTable
  metrics: MeshMetrics
  timings: MeshTimings
  log: MeshLogger
  openStream: (peerId: string, protocol: string, signal: AbortSignal) => Promise<Stream>
}

async function readLoadFrame (lp: LengthPrefixed, signal: AbortSignal): Promise<LoadFrame | undefined> {
  let bytes: Uint8Array
  try {
    bytes = (await lp.read({ signal })).subarray()
  } catch (err) {
    const name = (err as Error).name
    if (name === 'InvalidDataLengthError' || name === 'InvalidDataLengthLengthError') throw new WireError('SHOAL_ERR_MESH_TOO_LARGE', (err as Error).message)
    if (name === 'UnexpectedEOFError') return undefined
    throw err
  }
  return decodeLoadFrame(bytes)
}

export class LoadExchange {
  private readonly deps: LoadDeps
  private provider: (asker?: string) => LoadRecord = () => IDLE_LOAD
  private readonly pollers = new Map<string, AbortController>()
  private unsubscribe: (() => void) | undefined
  private nextId = 1

  constructor (deps: LoadDeps) {
    this.deps = deps
  }

  setProvider (provider: (asker?: string) => LoadRecord): void {
    this.provider = provider
  }

  /**
   * The local load as told to `asker` (or to nobody in particular), or idle when the provider
   * throws (a broken provider must not look busy forever).
   */
  current (asker?: string): LoadRecord {
    try {
      return parseLoadRecord(this.provider(asker))
    } catch (err) {
      this.deps.log.warn({ err: String(err) }, 'mesh: load provider failed')
      return IDLE_LOAD
    }
  }

  start (): void {
    this.unsubscribe = this.deps.peers.onChange(change => {
      if (change.kind === 'admitted') this.ensurePoller(change.peerId)
      else if (change.kind === 'refused' || change.kind === 'gone') this.stopPoller(change.peerId)
    })
    for (const peerId of this.deps.peers.admittedPeerIds()) this.ensurePoller(peerId)
  }

  stop (): void {
    this.unsubscribe?.()
    for (const peerId of [...this.pollers.keys()]) this.stopPoller(peerId)
  }

  private ensurePoller (peerId: string): void {
    if (this.pollers.has(peerId)) return
    const controller = new AbortController()
    this.pollers.set(peerId, controller)
    this.poll(peerId, controller.signal).catch(() => {}).finally(() => {
      if (this.pollers.get(peerId) === controller) this.pollers.delete(peerId)
    })
  }

  private stopPoller (peerId: string): void {
    this.pollers.get(peerId)?.abort()
    this.pollers.delete(peerId)
  }

  /** One poller per admitted peer: (re)opens the stream, asks, records, waits, until aborted. */
  private async poll (peerId: string, signal: AbortSignal): Promise<void> {
    const { loadIntervalMs, suspectAfterMs } = this.deps.timings
    const replyTimeout = Math.max(suspectAfterMs, 2 * loadIntervalMs)
    while (!signal.aborted && this.deps.peers.isAdmitted(peerId)) {
      let stream: Stream | undefined
      try {
        stream = await this.deps.openStream(peerId, LOAD_PROTOCOL, AbortSignal.any([signal, AbortSignal.timeout(replyTimeout)]))
        const lp = await lengthPrefixed(stream, LOAD_MAX_FRAME)
        while (!signal.aborted) {
          const id = this.nextId = (this.nextId + 1) % 0xffffffff
          const started = performance.now()
          const step = AbortSignal.any([signal, AbortSignal.timeout(replyTimeout)])
          await lp.write(encodeLoadFrame({ v: 1, type: 'req', id }), { signal: step })
          const reply = await readLoadFrame(lp, step)
          if (reply === undefined) break
          if (reply.type === 'error') throw new WireError(reply.code, `remote: ${reply.message}`)
          if (reply.type !== 'load' || reply.id !== id) throw new WireError('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected load #${id}`)
          const rtt = performance.now() - started
          this.deps.peers.setLoad(peerId, reply.load, rtt, Date.now())
          await sleep(Math.max(0, loadIntervalMs - rtt), undefined, { signal })
        }
      } catch (err) {
        if (err instanceof WireError) this.deps.metrics.wireErrors.inc({ protocol: LOAD_PROTOCOL, code: err.code })
        stream?.abort(err instanceof Error ? err : new Error(String(err)))
        stream = undefined
      }
      await stream?.close().catch(() => {})
      // A broken stream is retried at the poll rate; liveness decides when the peer is gone.
      await sleep(loadIntervalMs, undefined, { signal }).catch(() => {})
    }
  }

  /** Serves load requests on an inbound stream, at most one per quarter interval. */
  readonly handler = async (stream: Stream, connection: Connection): Promise<void> => {
    const asker = connection.remotePeer.toString()
    const lp = await lengthPrefixed(stream, LOAD_MAX_FRAME)
    const minGap = this.deps.timings.loadIntervalMs / 4
    let last = -Infinity
    // The stream lives as long as the poller keeps it; each read waits at most the gone bound.
    try {
      while (true) {
        const frame = await readLoadFrame(lp, AbortSignal.timeout(this.deps.timings.goneAfterMs))
        if (frame === undefined) break
        if (frame.type !== 'req') {
          await lp.write(encodeLoadFrame(errorFrame('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected req, got ${frame.type}`)))
          continue
        }
        const now = performance.now()
        if (now - last < minGap) {
          this.deps.metrics.wireErrors.inc({ protocol: LOAD_PROTOCOL, code: 'SHOAL_ERR_MESH_RATE_LIMITED' })
          await lp.write(encodeLoadFrame(errorFrame('SHOAL_ERR_MESH_RATE_LIMITED', `at most one request per ${minGap} ms`, frame.id)))
          continue
        }
        last = now
        await lp.write(encodeLoadFrame({ v: 1, type: 'load', id: frame.id, load: this.current(asker) }))
      }
      await stream.close().catch(() => {})
    } catch (err) {
      if (err instanceof WireError) {
        this.deps.metrics.wireErrors.inc({ protocol: LOAD_PROTOCOL, code: err.code })
        await lp.write(encodeLoadFrame(errorFrame(err.code, err.message))).catch(() => {})
      }
      stream.abort(err instanceof Error ? err : new Error(String(err)))
    }
  }
}
