/**
 * The ingress's client-key decision (`--require-keys`): a bearer token is valid when the node's CA
 * signed it as a client key, it is within its validity and the newest revocation list this node
 * holds does not name it. Offline: nothing but the CA certificate and the list is consulted.
 */
import { verifyClientKey } from '../../certs/index.ts'
import type { CaCertificate, RevocationList } from '../../certs/index.ts'
import type { ClientAuth } from '../ingress/index.ts'

export function createClientAuth (init: {
  caCertificate: CaCertificate
  /** The newest list at the moment of the check (the mesh's, which newer lists replace). */
  revocations: () => RevocationList | undefined
  now?: () => number
}): ClientAuth {
  const now = init.now ?? Date.now
  return {
    check (token) {
      const revocations = init.revocations()
      const result = verifyClientKey({ caCertificate: init.caCertificate, token, now: now(), ...(revocations === undefined ? {} : { revocations }) })
      if (!result.ok) return { ok: false, detail: `${result.reason}: ${result.detail}` }
      return { ok: true, client: { name: result.key.body.name, serial: result.key.body.serial } }
    },
  }
}
