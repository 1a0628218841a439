/**
 * Receipts: every completion leaves a signed, hash-chained record a third party can check
 * (what was asked and answered — as hashes —, which model, which nodes, when). The ledger is the
 * node's append-only log of them in level under DATA/receipts; executors sign their share of a
 * request as a receipt part that the ingress embeds. Byte-level format: ./README.md.
 */
export { createLedger } from './ledger.ts'
export type { AppendOptions, Ledger, LedgerInit, LedgerComponents, LedgerSigner } from './ledger.ts'
export {
  RECEIPT_FORMAT, GENESIS_HASH, buildReceiptInput, requestContent, responseContent, requestHash,
  responseHash, createReceiptPart, verifyReceiptPart, entryHash,
} from './receipt.ts'
export type {
  ReceiptBody, ReceiptInput, SignedReceipt, ReceiptPartBody, ReceiptPartInput, SignedReceiptPart,
  RouteHop, LayerRange, RequestLike, CompletionOutput, ReceiptContext, ExpertsServed,
} from './receipt.ts'
export { verifyLog, VERIFY_REASONS } from './verify.ts'
export type { VerifyOptions, VerifyReport, VerifyReason } from './verify.ts'
export { verifyReceipt } from './verify-one.ts'
export type { ReceiptCheck, ReceiptVerification } from './verify-one.ts'
export { openDb, hasLog, receiptsLocation, tailText, allText } from './store.ts'
export type { LedgerDb } from './store.ts'
export { publicKeyFromPeerId } from './keys.ts'
export {
  WITNESSED_HEADS_FORMAT, MAX_HEAD_BYTES, MAX_WITNESSED_SIGNERS, createLogHead, parseLogHead, verifyLogHead,
  chooseHead, headsFromFile,
} from './head.ts'
export type { LogHeadBody, SignedLogHead, WitnessedHeadsFile } from './head.ts'
