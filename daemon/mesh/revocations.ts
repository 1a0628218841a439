/**
 * The revocation list in force on this node: read from a file at start, replaced by any newer
 * CA-signed list that arrives (admission hello, gossip, operator), written back to the file.
 * Judging a list is certs/'s job; this keeps the newest and says when it changed.
 */
import { access } from 'node:fs/promises'
import { isNewerRevocationList, parseRevocationList, readRevocationFile, writeRevocationFile } from '../../certs/index.ts'
import type { CaCertificate, RevocationList } from '../../certs/index.ts'
import { errorCodeOf } from '../errors.ts'

export type RevocationOffer =
  | { adopted: true, list: RevocationList }
  | { adopted: false, why: 'not-newer' }
  | { adopted: false, why: 'invalid', code: string, detail: string }

export class RevocationState {
  private list: RevocationList | undefined
  private revoked: ReadonlySet<string> = new Set()
  private readonly ca: CaCertificate
  private readonly file: string | undefined
  private writing: Promise<void> = Promise.resolve()
  private readonly onWriteError: (err: unknown) => void

  constructor (ca: CaCertificate, file: string | undefined, onWriteError: (err: unknown) => void) {
    this.ca = ca
    this.file = file
    this.onWriteError = onWriteError
  }

  /** Reads the file when it exists. A file that exists but is not a valid list is an error. */
  async load (): Promise<void> {
    if (this.file === undefined) return
    try {
      await access(this.file)
    } catch {
      return
    }
    this.set(await readRevocationFile(this.file, this.ca))
  }

  get current (): RevocationList | undefined {
    return this.list
  }

  get revokedSerials (): ReadonlySet<string> {
    return this.revoked
  }

  private set (list: RevocationList): void {
    this.list = list
    this.revoked = new Set(list.body.revoked)
  }

  /** Adopts `doc` when it is a valid list of our CA and newer than the one held. */
  offer (doc: unknown): RevocationOffer {
    let list: RevocationList
    try {
      list = parseRevocationList(this.ca, doc)
    } catch (err) {
      return { adopted: false, why: 'invalid', code: errorCodeOf(err) ?? 'SHOAL_ERR_CERT_MALFORMED', detail: err instanceof Error ? err.message : String(err) }
    }
    if (!isNewerRevocationList(list, this.list)) return { adopted: false, why: 'not-newer' }
    this.set(list)
    const file = this.file
    if (file !== undefined) {
      // Serialised so an older list can never overwrite a newer one on disk.
      this.writing = this.writing.then(async () => {
        if (this.list === list) await writeRevocationFile(file, list)
      }).catch(this.onWriteError)
    }
    return { adopted: true, list }
  }

  /** Resolves when pending writes are on disk. */
  async flush (): Promise<void> {
    await this.writing
  }
}
