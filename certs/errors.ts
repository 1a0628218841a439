/**
 * Typed errors of the certs module. Refusals of a presented certificate are values (`Admission`),
 * not errors; these are thrown only where a caller cannot go on: a local CA certificate, revocation
 * list or identity that is not valid, and CA operations refused (existing CA, unknown node, …).
 */
import { ShoalError, type ShoalErrorCode } from '../daemon/errors.ts'

/** Why a certificate is not admitted. Stable strings: they appear in `/v1/mesh` and in logs. */
export type RefusalReason =
  | 'malformed'
  | 'unknown-format-version'
  | 'wrong-ca'
  | 'bad-signature'
  | 'expired'
  | 'not-yet-valid'
  | 'revoked'
  | 'peer-id-mismatch'

export const REFUSAL_REASONS: readonly RefusalReason[] = Object.freeze([
  'malformed', 'unknown-format-version', 'wrong-ca', 'bad-signature',
  'expired', 'not-yet-valid', 'revoked', 'peer-id-mismatch',
])

/** `SHOAL_ERR_CERT_<REASON>` for each refusal reason, spelled out so every code is in the catalogue. */
const CERT_CODES = {
  malformed: 'SHOAL_ERR_CERT_MALFORMED',
  'unknown-format-version': 'SHOAL_ERR_CERT_UNKNOWN_FORMAT_VERSION',
  'wrong-ca': 'SHOAL_ERR_CERT_WRONG_CA',
  'bad-signature': 'SHOAL_ERR_CERT_BAD_SIGNATURE',
  expired: 'SHOAL_ERR_CERT_EXPIRED',
  'not-yet-valid': 'SHOAL_ERR_CERT_NOT_YET_VALID',
  revoked: 'SHOAL_ERR_CERT_REVOKED',
  'peer-id-mismatch': 'SHOAL_ERR_CERT_PEER_ID_MISMATCH',
} as const satisfies Record<RefusalReason, Extract<ShoalErrorCode, `SHOAL_ERR_CERT_${string}`>>

export type CertErrorCode = typeof CERT_CODES[RefusalReason] | 'SHOAL_ERR_CERT_FILE'

/** The code of a refusal reason, e.g. 'peer-id-mismatch' → SHOAL_ERR_CERT_PEER_ID_MISMATCH. */
export function certErrorCode (reason: RefusalReason): CertErrorCode {
  return CERT_CODES[reason]
}

/** A certificate, CA certificate, revocation list or identity file that cannot be used. */
export class CertificateError extends ShoalError {
  override name = 'CertificateError'
  declare readonly code: CertErrorCode
  /** Set when the problem is one of the refusal reasons; absent for I/O problems (SHOAL_ERR_CERT_FILE). */
  readonly reason: RefusalReason | undefined
  constructor (reasonOrCode: RefusalReason | 'file', message: string, options?: ErrorOptions) {
    super(reasonOrCode === 'file' ? 'SHOAL_ERR_CERT_FILE' : certErrorCode(reasonOrCode), message, options)
    this.reason = reasonOrCode === 'file' ? undefined : reasonOrCode
  }
}

export type CaErrorKind = 'exists' | 'not-found' | 'unknown-node' | 'name-taken' | 'out-exists' | 'bad-option' | 'busy'

const CA_CODES = {
  exists: 'SHOAL_ERR_CA_EXISTS',
  'not-found': 'SHOAL_ERR_CA_NOT_FOUND',
  'unknown-node': 'SHOAL_ERR_CA_UNKNOWN_NODE',
  'name-taken': 'SHOAL_ERR_CA_NAME_TAKEN',
  'out-exists': 'SHOAL_ERR_CA_OUT_EXISTS',
  'bad-option': 'SHOAL_ERR_CA_BAD_OPTION',
  busy: 'SHOAL_ERR_CA_BUSY',
} as const satisfies Record<CaErrorKind, Extract<ShoalErrorCode, `SHOAL_ERR_CA_${string}`>>

export type CaErrorCode = typeof CA_CODES[CaErrorKind]

/** An operator CA operation refused (the CLI turns these into exit 2 with the message). */
export class CaError extends ShoalError {
  override name = 'CaError'
  declare readonly code: CaErrorCode
  readonly kind: CaErrorKind
  constructor (kind: CaErrorKind, message: string, options?: ErrorOptions) {
    super(CA_CODES[kind], message, options)
    this.kind = kind
  }
}
