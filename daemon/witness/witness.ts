/**
 * Witnessed log heads on the mesh. Every `intervalMs` this node signs its receipt-log head (count +
 * hash) when it changed (and at least every `refreshMs`), and hands it to each live admitted peer
 * over `/shoal/heads/1.0.0` (and to a peer at once when it is admitted). It keeps, per peer, the
 * newest head that peer signed about its own log (the certificate it was admitted with gives the
 * key), persisted in DATA/witnessed-heads.json. A head that shrinks or forks is refused and logged:
 * that is a truncated or rewritten log, and the held head is the evidence `receipts verify --heads`
 * uses.
 */
import type { Connection, Stream } from '@libp2p/interface'
import { join } from 'node:path'
import { fromBase64url } from '../../certs/index.ts'
import { createLogHead, verifyLogHead } from '../ledger/index.ts'
import type { SignedLogHead } from '../ledger/index.ts'
import { lengthPrefixed } from '../mesh/index.ts'
import type { Mesh } from '../mesh/index.ts'
import { createHeadStore, WITNESSED_HEADS_FILE } from './store.ts'
import type { HeadOffer, HeadStore } from './store.ts'
import { HEADS_PROTOCOL, MAX_HEAD_FRAME, decodeHeadFrame, encodeHeadFrame } from './wire.ts'

export interface WitnessInit {
  signer: { peerId: string, secretKey: Uint8Array }
  /** The log's current head (the ledger's). */
  head: () => { count: number, hash: string }
  /** Where witnessed-heads.json lives (the node's --data). */
  dataDir: string
  /** How often the head is checked and, if changed, signed and handed out. Default 10 s. */
  intervalMs?: number
  /** An unchanged head is signed and handed out again this often. Default 60 s. */
  refreshMs?: number
  now?: () => number
}

export interface WitnessComponents {
  mesh: Pick<Mesh, 'peerId' | 'handle' | 'openStream' | 'peers' | 'onChange' | 'certificateOf'>
  logger?: { warn: (obj: object, msg?: string) => void, debug: (obj: object, msg?: string) => void }
}

export interface Witness {
  start (): Promise<void>
  stop (): Promise<void>
  /** Signs the current head now and hands it to every live peer (tests; the timer does this). */
  publish (): Promise<void>
  /** Heads witnessed so far, one per peer. */
  heads (): SignedLogHead[]
  readonly file: string
}

const STREAM_TIMEOUT_MS = 5_000

export function createWitness (init: WitnessInit, components: WitnessComponents): Witness {
  const { mesh } = components
  const log = components.logger
  const now = init.now ?? Date.now
  const intervalMs = init.intervalMs ?? 10_000
  const refreshMs = init.refreshMs ?? 60_000
  const file = join(init.dataDir, WITNESSED_HEADS_FILE)
  const store: HeadStore = createHeadStore(file, err => { log?.warn({ err: String(err), file }, 'witness: could not write witnessed heads') })
  let signed: SignedLogHead | undefined
  let timer: ReturnType<typeof setInterval> | undefined
  let unsubscribe: (() => void) | undefined
  let running = false
  /** The mesh cannot unregister a protocol: the handler stays, and refuses streams while stopped. */
  let handled = false

  function current (): SignedLogHead {
    const h = init.head()
    const t = now()
    if (signed === undefined || signed.body.count !== h.count || signed.body.hash !== h.hash || t - signed.body.timestamp >= refreshMs) {
      signed = createLogHead({ signer: init.signer.peerId, count: h.count, hash: h.hash, timestamp: t }, init.signer.secretKey)
    }
    return signed
  }

  async function pushTo (peerId: string, head: SignedLogHead): Promise<void> {
    let stream: Stream | undefined
    try {
      const signal = AbortSignal.timeout(STREAM_TIMEOUT_MS)
      stream = await mesh.openStream(peerId, HEADS_PROTOCOL, signal)
      await (await lengthPrefixed(stream, MAX_HEAD_FRAME)).write(encodeHeadFrame(head), { signal })
      await stream.close({ signal })
    } catch (err) {
      stream?.abort(err instanceof Error ? err : new Error(String(err)))
      log?.debug({ peerId, err: String(err) }, 'witness: could not hand our log head to a peer')
    }
  }

  async function publish (): Promise<void> {
    const before = signed
    const head = current()
    if (head === before) return
    await Promise.all(mesh.peers().filter(p => p.state === 'alive').map(async p => { await pushTo(p.peerId, head) }))
  }

  /** One head from `from`, about `from`'s own log, signed with the key it was admitted with. */
  function receive (from: string, head: SignedLogHead): HeadOffer | 'other-signer' | 'bad-signature' {
    if (head.body.signer !== from) return 'other-signer'
    const key = fromBase64url(mesh.certificateOf(from)?.body.publicKey ?? '')
    if (key === undefined || key.length !== 32 || !verifyLogHead(head, key)) return 'bad-signature'
    return store.offer(head)
  }

  async function handler (stream: Stream, connection: Connection): Promise<void> {
    const from = connection.remotePeer.toString()
    if (!running) {
      stream.abort(new Error('witness is stopped'))
      return
    }
    try {
      const bytes = (await (await lengthPrefixed(stream, MAX_HEAD_FRAME)).read({ signal: AbortSignal.timeout(STREAM_TIMEOUT_MS) })).subarray()
      const head = decodeHeadFrame(bytes)
      const outcome = receive(from, head)
      if (outcome === 'shrunk' || outcome === 'forked') {
        log?.warn({ peerId: from, held: store.get(from)?.body, offered: head.body }, `witness: peer's receipt log ${outcome === 'shrunk' ? 'shrank' : 'forked'}; keeping the head witnessed before`)
      } else if (outcome !== 'take' && outcome !== 'keep') {
        log?.warn({ peerId: from, outcome }, 'witness: log head refused')
      }
      await stream.close({ signal: AbortSignal.timeout(STREAM_TIMEOUT_MS) }).catch(() => {})
    } catch (err) {
      stream.abort(err instanceof Error ? err : new Error(String(err)))
    }
  }

  return {
    file,
    async start () {
      if (running) return
      await store.load()
      if (!handled) {
        await mesh.handle(HEADS_PROTOCOL, (stream, connection) => { void handler(stream, connection) }, { maxInboundStreams: 8, maxOutboundStreams: 8 })
        handled = true
      }
      unsubscribe = mesh.onChange(change => {
        if (change.kind === 'admitted' && running) void pushTo(change.peerId, current())
      })
      timer = setInterval(() => { void publish() }, intervalMs)
      timer.unref?.()
      running = true
    },
    async stop () {
      running = false
      if (timer !== undefined) clearInterval(timer)
      timer = undefined
      unsubscribe?.()
      unsubscribe = undefined
      await store.flush()
    },
    publish: async () => {
      signed = undefined
      await publish()
    },
    heads: () => store.all(),
  }
}
