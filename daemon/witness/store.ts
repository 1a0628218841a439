/**
 * The heads this node witnessed: the latest signed log head of each peer, in memory and in
 * DATA/witnessed-heads.json (`shoal.witnessed-heads/1`, written atomically: temp file + rename,
 * serialised so an older state never overwrites a newer one). `shoal receipts verify --heads FILE`
 * reads that file. A peer's head that shrinks or forks is never taken: it is kept as evidence.
 */
import { randomBytes } from 'node:crypto'
import { readFile, rename, rm, writeFile } from 'node:fs/promises'
import { MAX_WITNESSED_SIGNERS, WITNESSED_HEADS_FORMAT, chooseHead, headsFromFile } from '../ledger/index.ts'
import type { SignedLogHead, WitnessedHeadsFile } from '../ledger/index.ts'

export const WITNESSED_HEADS_FILE = 'witnessed-heads.json'

export type HeadOffer = 'take' | 'keep' | 'shrunk' | 'forked' | 'full'

export interface HeadStore {
  load (): Promise<void>
  /** Takes `head` (already verified as its signer's) when it is newer than the one held. */
  offer (head: SignedLogHead): HeadOffer
  get (signer: string): SignedLogHead | undefined
  all (): SignedLogHead[]
  /** Resolves when every taken head is on disk. */
  flush (): Promise<void>
}

export function createHeadStore (file: string, onWriteError: (err: unknown) => void): HeadStore {
  const heads = new Map<string, SignedLogHead>()
  let writing: Promise<void> = Promise.resolve()
  let dirty = false

  const write = async (): Promise<void> => {
    if (!dirty) return
    dirty = false
    const doc: WitnessedHeadsFile = { format: WITNESSED_HEADS_FORMAT, heads: Object.fromEntries([...heads.entries()].sort(([a], [b]) => a < b ? -1 : a > b ? 1 : 0)) }
    const temp = `${file}.${randomBytes(6).toString('hex')}.tmp`
    try {
      await writeFile(temp, `${JSON.stringify(doc, null, 2)}\n`, { flag: 'wx', flush: true })
      await rename(temp, file)
    } catch (err) {
      await rm(temp, { force: true }).catch(() => {})
      throw err
    }
  }

  return {
    async load () {
      let text: string
      try {
        text = await readFile(file, 'utf8')
      } catch {
        return // no witness file yet
      }
      let doc: unknown
      try {
        doc = JSON.parse(text)
      } catch {
        return onWriteError(new Error(`${file} is not JSON; starting without witnessed heads`))
      }
      // Heads were verified when they were taken; the file is this node's own state.
      for (const head of headsFromFile(doc).heads) heads.set(head.body.signer, head)
    },
    offer (head) {
      const held = heads.get(head.body.signer)
      if (held === undefined && heads.size >= MAX_WITNESSED_SIGNERS) return 'full'
      const choice = chooseHead(held?.body, head.body)
      if (choice !== 'take') return choice
      heads.set(head.body.signer, head)
      dirty = true
      writing = writing.then(write).catch(onWriteError)
      return 'take'
    },
    get: signer => heads.get(signer),
    all: () => [...heads.values()],
    async flush () { await writing },
  }
}
