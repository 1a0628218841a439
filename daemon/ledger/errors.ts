/**
 * Errors of the receipt ledger. Codes are stable; callers compare `code`, never `instanceof`.
 */
import { ShoalError } from '../errors.ts'

/** The ledger is not started, or is stopping: no appends are taken. */
export class LedgerClosedError extends ShoalError {
  override name = 'LedgerClosedError'
  constructor (message = 'receipt ledger is not running') {
    super('SHOAL_ERR_LEDGER_CLOSED', message)
  }
}

/** The bounded append queue is full: the disk cannot keep up. */
export class LedgerBusyError extends ShoalError {
  override name = 'LedgerBusyError'
  constructor (pending: number) {
    super('SHOAL_ERR_LEDGER_BUSY', `receipt ledger has ${pending} appends pending; refusing more`)
  }
}

/** The receipt input is not well formed (bad hash, negative count, …) or its id is already logged. */
export class InvalidReceiptError extends ShoalError {
  override name = 'InvalidReceiptError'
  constructor (message: string) {
    super('SHOAL_ERR_LEDGER_INVALID', message)
  }
}

/** The signer's key does not match its peer id or certificate: appending would write an unverifiable log. */
export class SignerMismatchError extends ShoalError {
  override name = 'SignerMismatchError'
  constructor (message: string) {
    super('SHOAL_ERR_LEDGER_SIGNER', message)
  }
}


/** The stored log cannot be continued (unreadable last entry, unknown format). */
export class LedgerCorruptError extends ShoalError {
  override name = 'LedgerCorruptError'
  constructor (message: string) {
    super('SHOAL_ERR_LEDGER_CORRUPT', message)
  }
}
