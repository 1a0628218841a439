/**
 * Admission's certificate checks: a presented certificate against the CA, the newest revocation
 * list and the transport-proven peer id; and an admitted peer's stored certificate again after
 * the revocation list or the clock moved.
 */
import { CLOCK_SKEW_MS, verifyNodeCertificate } from '../../certs/index.ts'
import type { NodeCertificate, NodeIdentity } from '../../certs/index.ts'
import { reviewAdmission } from './decisions.ts'
import type { Verification } from './decisions.ts'
import type { RevocationState } from './revocations.ts'

export type CertificateCheck = Verification & { certificate?: NodeCertificate }

export function checkPeerCertificate (
  identity: NodeIdentity, revocations: RevocationState, certificate: unknown, peerId: string, now: number,
): CertificateCheck {
  const result = verifyNodeCertificate({
    caCertificate: identity.caCertificate,
    revocations: revocations.current,
    certificate,
    peerId,
    now,
  })
  return result.admitted ? { admitted: true, certificate: result.certificate } : result
}

/** Whether an admitted peer's certificate still holds under the current revocations at `now`. */
export function recheckCertificate (certificate: NodeCertificate, revocations: RevocationState, now: number): Verification {
  return reviewAdmission({
    serial: certificate.body.serial,
    notAfterMs: Date.parse(certificate.body.notAfter) + CLOCK_SKEW_MS,
    revokedSerials: revocations.revokedSerials,
    now,
  })
}
