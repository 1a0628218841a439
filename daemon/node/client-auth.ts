/**
 * The ingress's client-key decision (`--require-keys`): a bearer token is valid when the node's CA
 * signed it as a client key, it is within its validity and the newest revocation list this node
 * holds does not name it. Offline: nothing but the CA certificate and the list is consulted.
 *
 * The signature check (ed25519, measured ~0.1-0.6 ms on a loaded 2-core machine) is done once per
 * token: tokens that verified are remembered (bounded, oldest dropped first), and a remembered one
 * is re-checked only against what changes — the revocation list and the clock. When either says no,
 * the token goes through the full check again, so the refusal reason is the decision's own.
 */
import { CLOCK_SKEW_MS, verifyClientKey } from '../../certs/index.ts'
import type { CaCertificate, ClientKey, RevocationList } from '../../certs/index.ts'
import type { ClientAuth } from '../ingress/index.ts'

/** Distinct valid keys remembered (a fleet's clients); each entry is a few hundred bytes. */
const MAX_REMEMBERED = 4096

export function createClientAuth (init: {
  caCertificate: CaCertificate
  /** The newest list at the moment of the check (the mesh's, which newer lists replace). */
  revocations: () => RevocationList | undefined
  now?: () => number
}): ClientAuth {
  const now = init.now ?? Date.now
  const ca = init.caCertificate.body
  const remembered = new Map<string, { key: ClientKey, from: number, until: number }>()
  const revokedSets = new WeakMap<RevocationList, ReadonlySet<string>>()
  const revokedIn = (list: RevocationList | undefined, serial: string): boolean => {
    if (list === undefined) return false
    let set = revokedSets.get(list)
    if (set === undefined) revokedSets.set(list, set = new Set(list.body.revoked))
    return set.has(serial)
  }
  const ok = (key: ClientKey) => ({ ok: true as const, client: { name: key.body.name, serial: key.body.serial } })

  return {
    check (token) {
      const revocations = init.revocations()
      const t = now()
      const hit = remembered.get(token)
      if (hit !== undefined) {
        if (!revokedIn(revocations, hit.key.body.serial) && t >= hit.from && t <= hit.until) return ok(hit.key)
        remembered.delete(token)
      }
      const result = verifyClientKey({ caCertificate: init.caCertificate, token, now: t, ...(revocations === undefined ? {} : { revocations }) })
      if (!result.ok) return { ok: false, detail: `${result.reason}: ${result.detail}` }
      const body = result.key.body
      if (remembered.size >= MAX_REMEMBERED) remembered.delete(remembered.keys().next().value as string)
      remembered.set(token, {
        key: result.key,
        // The window verifyClientKey admits in: both validities, widened by the clock skew.
        from: Math.max(Date.parse(body.notBefore), Date.parse(ca.notBefore)) - CLOCK_SKEW_MS,
        until: Math.min(Date.parse(body.notAfter), Date.parse(ca.notAfter)) + CLOCK_SKEW_MS,
      })
      return ok(result.key)
    },
  }
}
