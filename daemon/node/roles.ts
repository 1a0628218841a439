/**
 * Certificate roles, enforced: only `worker` certificates execute work for others, only `ingress`
 * certificates accept API traffic. A pure decision per protocol over the roles this node and the
 * asking peer were certified with (the peer's as the mesh admitted it); the daemon refuses the
 * stream with the typed error it returns, and routing never picks a peer without `worker`.
 *
 *   /shoal/infer  (a forwarded API request): this node must be a worker, the asker an ingress
 *                  (API traffic enters the mesh only through an ingress).
 *   /shoal/stage  (a pipeline stage's activations): this node and the upstream stage must both be
 *                  workers (every stage of a chain executes work).
 *   /shoal/kv     (a pull of a kept prefix's KV): both workers — only a node that runs requests
 *                  has a use for another's KV, and only a worker kept any.
 *   /shoal/experts (a MoE stage's rows for an expert holder): both workers, as for a stage.
 */
import { ShoalError } from '../errors.ts'

export type RoleProtocol = 'infer' | 'stage' | 'kv' | 'experts'

export class RoleRefusedError extends ShoalError {
  override name = 'RoleRefusedError'
  constructor (message: string) {
    super('SHOAL_ERR_ROLE_REFUSED', message)
  }
}

const NEEDS: Record<RoleProtocol, { self: string, peer: string, what: string }> = {
  infer: { self: 'worker', peer: 'ingress', what: 'forwarded requests' },
  stage: { self: 'worker', peer: 'worker', what: 'pipeline stage work' },
  kv: { self: 'worker', peer: 'worker', what: 'kept KV prefixes' },
  experts: { self: 'worker', peer: 'worker', what: 'expert computation' },
}

/** Why `peerId` may not use `protocol` on this node, or undefined when it may. `peerRoles` undefined: not admitted with a certificate. */
export function roleRefusal (protocol: RoleProtocol, selfRoles: readonly string[], peerId: string, peerRoles: readonly string[] | undefined): RoleRefusedError | undefined {
  const need = NEEDS[protocol]
  if (!selfRoles.includes(need.self)) {
    return new RoleRefusedError(`this node's certificate has roles ${selfRoles.join(',') || 'none'}: only ${need.self} certificates execute ${need.what}`)
  }
  if (peerRoles === undefined || !peerRoles.includes(need.peer)) {
    return new RoleRefusedError(`peer ${peerId} is certified as ${peerRoles?.join(',') ?? 'nothing'}: only ${need.peer} certificates may ask for ${need.what}`)
  }
  return undefined
}

/** The ingress gate: an identity without `ingress` must not serve the API. */
export function ingressRefusal (selfRoles: readonly string[], name: string): RoleRefusedError | undefined {
  if (selfRoles.includes('ingress')) return undefined
  return new RoleRefusedError(`--api: node ${name}'s certificate has roles ${selfRoles.join(',')}: only ingress certificates accept API traffic (issue one with --roles ingress or ingress,worker)`)
}
