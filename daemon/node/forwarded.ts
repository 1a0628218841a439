/**
 * Serving forwarded requests on the mesh: the `/shoal/infer` handler over this node's engines and
 * the load this node tells each peer. A node counts the forwarded requests it holds per sending
 * peer and tells each asker its own share (`fromYou`), so an ingress can swap that share for its
 * exact count of what it dispatched (see daemon/routing/routed-service.ts).
 */
import type { LoadRecord, Mesh } from '../mesh/index.ts'
import { INFER_PROTOCOL, handleInferStream } from '../routing/index.ts'
import type { InferenceService } from '../service.ts'

/** Streams a peer may open to this node for forwarded requests (libp2p's default of 32 is too few). */
const MAX_INFER_STREAMS = 256

export async function serveForwarded (
  mesh: Pick<Mesh, 'peerId' | 'handle' | 'setLoadProvider'>,
  executor: InferenceService,
  load: () => LoadRecord,
  /** Why a peer may not have work done here (certificate roles), or undefined; answered as a typed error frame. */
  authorize?: (from: string) => Error | undefined,
): Promise<void> {
  const held = createCounter()
  await mesh.handle(INFER_PROTOCOL, (stream, connection) => {
    const from = connection.remotePeer.toString()
    const refused = authorize?.(from)
    held.add(from, 1)
    void handleInferStream(stream, refused === undefined ? executor : refusing(executor, refused), { localPeerId: mesh.peerId }).finally(() => { held.add(from, -1) })
  }, { maxInboundStreams: MAX_INFER_STREAMS, maxOutboundStreams: MAX_INFER_STREAMS })
  mesh.setLoadProvider(asker => asker === undefined ? load() : { ...load(), fromYou: held.get(asker) })
}

/** A service that answers every request with `err` before it starts (the handler sends it as an error frame). */
function refusing (service: InferenceService, err: Error): InferenceService {
  return {
    models: () => service.models(),
    // eslint-disable-next-line require-yield
    async * generate () { throw err },
  }
}

/** Counts per key that drop the key at zero, so peers that come and go leave nothing behind. */
function createCounter (): { add(key: string, delta: number): void, get(key: string): number } {
  const counts = new Map<string, number>()
  return {
    add (key, delta) {
      const n = (counts.get(key) ?? 0) + delta
      if (n > 0) counts.set(key, n)
      else counts.delete(key)
    },
    get: key => counts.get(key) ?? 0,
  }
}
