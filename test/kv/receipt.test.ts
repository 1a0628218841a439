/**
 * A completion whose prompt prefix came from a KV cache says so in its signed receipt: `prefix`
 * names the node that reused the tokens and how many, and `movedFrom` the peer whose cache they
 * were pulled from first; taken from the service's start event, absent when the whole prompt was
 * prefilled. Real ledger, real level db.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterEach, beforeEach, describe, expect, it } from 'vitest'
import { createLedger } from '../../daemon/ledger/index.ts'
import type { ReceiptInput } from '../../daemon/ledger/index.ts'
import type { Ledger } from '../../daemon/ledger/index.ts'
import { withReceipts } from '../../daemon/node/index.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, PrefixReuse } from '../../daemon/service.ts'
import { makeSigner, sampleInput } from '../ledger/fixtures/keys.ts'

function serviceSaying (prefix: PrefixReuse | undefined): InferenceService {
  return {
    models: () => [],
    async * generate (request: GenerateRequest): AsyncIterable<GenerateEvent> {
      yield { type: 'start', promptTokenIds: [1, 2, 3], route: ['peer-b'], receiptId: request.requestId, ...(prefix === undefined ? {} : { prefix }) }
      yield { type: 'delta', text: 'hi', tokenIds: [7] }
      yield { type: 'end', finishReason: 'length', usage: { promptTokens: 3, completionTokens: 1 } }
    },
  }
}

const request = (requestId: string): GenerateRequest => ({
  requestId, model: 'tiny', prompt: { kind: 'tokens', ids: [1, 2, 3] }, maxTokens: 1, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 10_000,
})

let dir: string
let ledger: Ledger | undefined
beforeEach(async () => { dir = await mkdtemp(join(tmpdir(), 'shoal-kv-receipt-')) })
afterEach(async () => {
  await ledger?.stop()
  ledger = undefined
  await rm(dir, { recursive: true, force: true })
})

describe('the receipt names a reused or moved prefix', () => {
  it('records the reused tokens and where they were moved from, nothing when all was prefilled; the log verifies', async () => {
    ledger = createLedger({ dataDir: dir, signer: makeSigner() })
    await ledger.start()
    const moved: PrefixReuse = { peerId: 'peer-b', reusedTokens: 2, movedFrom: 'peer-a' }
    const reused: PrefixReuse = { peerId: 'peer-b', reusedTokens: 2 }
    for (const [id, use] of [['r-moved', moved], ['r-reused', reused], ['r-cold', undefined]] as const) {
      for await (const _ of withReceipts(serviceSaying(use), ledger).generate(request(id), new AbortController().signal)) { /* drain */ }
    }
    expect((await ledger.get('r-moved'))!.receipt.body.prefix).toEqual(moved)
    expect((await ledger.get('r-reused'))!.receipt.body.prefix).toEqual(reused)
    expect('prefix' in (await ledger.get('r-cold'))!.receipt.body).toBe(false)
    expect((await ledger.verify()).ok).toBe(true)
    await expect(ledger.append({ ...sampleInput('x'), prefix: 'moved' } as unknown as ReceiptInput)).rejects.toThrow(/prefix/)
  })
})
