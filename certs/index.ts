/**
 * certs — admission to the mesh. An operator CA (kept off the inference path) issues node
 * certificates binding a name, roles and validity to a libp2p ed25519 key; a CA-signed revocation
 * list withdraws them. `verifyNodeCertificate` is the one admission decision the mesh enforces.
 * All documents use the one signing scheme of `signed.ts`; the exact bytes are in README.md.
 */
export type { SignedDocument } from './signed.ts'
export { canonicalBytes, signDocument, verifyDocument, toBase64url, fromBase64url, publicKeyOf } from './signed.ts'
export { CertificateError, CaError, REFUSAL_REASONS, certErrorCode } from './errors.ts'
export type { RefusalReason, CaErrorKind, CertErrorCode, CaErrorCode } from './errors.ts'
export {
  FORMAT_VERSION, CA_CERTIFICATE_TYPE, NODE_CERTIFICATE_TYPE, REVOCATION_LIST_TYPE, CLIENT_KEY_TYPE, MAX_REVOKED, ROLES,
  keyIdOf, toTimestamp, isValidName,
} from './schema.ts'
export type {
  Role, Timestamp, CaCertificateBody, NodeCertificateBody, RevocationListBody,
  CaCertificate, NodeCertificate, RevocationList, ClientKeyBody, ClientKey,
} from './schema.ts'
export { CLIENT_KEY_PREFIX, MAX_CLIENT_KEY_LENGTH, createClientKey, encodeClientKey, decodeClientKey, verifyClientKey } from './client-key.ts'
export type { ClientKeyCheck } from './client-key.ts'
export { CLOCK_SKEW_MS, verifyNodeCertificate, parseCaCertificate, parseRevocationList, isNewerRevocationList } from './verify.ts'
export type { Admission } from './verify.ts'
export { createCaCertificate, createNodeCertificate, createRevocationList } from './issue.ts'
export { initCa, issueNode, issueKey, revokeNode, listNodes, listKeys, readCaRevocations, CA_VALIDITY_DAYS, MAX_NODE_DAYS } from './ca.ts'
export type { NodeListing, KeyListing } from './ca.ts'
export { loadIdentity, readCaCertificateFile, readRevocationFile, writeRevocationFile, keepNewestRevocationList } from './identity.ts'
export type { NodeIdentity } from './identity.ts'
export { createThrowawayCa } from './throwaway.ts'
export type { ThrowawayCa } from './throwaway.ts'
export { loadOrCreateNodeKey } from './local-key.ts'
export type { LocalKey } from './local-key.ts'
