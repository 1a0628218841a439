/** Every completed response gets a receipt in the real ledger before its `end` event; failures get none. */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { randomBytes, randomUUID } from 'node:crypto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import { privateKeyFromRaw } from '@libp2p/crypto/keys'
import { publicKeyOf } from '../../certs/index.ts'
import { createLedger, responseHash, type Ledger } from '../../daemon/ledger/index.ts'
import { withReceipts } from '../../daemon/node/index.ts'
import { withReceiptPart } from '../../daemon/node/receipt-part.ts'
import { requestHash } from '../../daemon/ledger/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { createSimulatedService } from '../support/simulated-service.ts'

const request = (over: Partial<GenerateRequest> = {}): GenerateRequest => ({
  requestId: randomUUID(),
  model: 'sim',
  prompt: { kind: 'text', text: 'hi' },
  sampling: { temperature: 0, topP: 1 },
  stop: [],
  deadline: Date.now() + 60_000,
  ...over,
})

async function drain (events: AsyncIterable<GenerateEvent>): Promise<GenerateEvent[]> {
  const out: GenerateEvent[] = []
  for await (const e of events) out.push(e)
  return out
}

describe('receipts on every completion', () => {
  let dir: string
  let ledger: Ledger
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'shoal-receipted-'))
    const seed = new Uint8Array(randomBytes(32))
    const key = privateKeyFromRaw(new Uint8Array([...seed, ...publicKeyOf(seed)]))
    ledger = createLedger({ dataDir: dir, signer: { peerId: peerIdFromPrivateKey(key).toString(), secretKey: seed } })
    await ledger.start()
  })
  afterAll(async () => {
    await ledger.stop()
    await rm(dir, { recursive: true, force: true })
  })

  it('appends the receipt before the end event reaches the client', async () => {
    const service = withReceipts(createSimulatedService({ models: ['sim'], script: { reply: 'abc' } }), ledger)
    const req = request()
    let seenAtEnd: unknown
    const events: GenerateEvent[] = []
    for await (const e of service.generate(req, new AbortController().signal)) {
      if (e.type === 'end') seenAtEnd = await ledger.get(req.requestId)
      events.push(e)
    }
    expect(seenAtEnd).toBeDefined()
    const stored = (await ledger.get(req.requestId))!.receipt
    const text = events.filter(e => e.type === 'delta').map(e => (e as { text: string }).text).join('')
    const ids = events.flatMap(e => e.type === 'delta' ? e.tokenIds : [])
    expect(text).toBe('abc')
    expect(stored.body.responseHash).toBe(responseHash({ text, tokenIds: ids, finishReason: 'stop' }))
    expect(stored.body.route).toEqual([{ peerId: 'sim-node' }])
    expect((await ledger.verify()).ok).toBe(true)
  })

  it('embeds the executing peer\'s signed part, bound to the same request and response hashes', async () => {
    const seed = new Uint8Array(randomBytes(32))
    const peerId = peerIdFromPrivateKey(privateKeyFromRaw(new Uint8Array([...seed, ...publicKeyOf(seed)]))).toString()
    const executor = withReceiptPart(createSimulatedService({ models: ['sim'], script: { reply: 'xyz' } }), { peerId, secretKey: seed })
    const req = request()
    await drain(withReceipts(executor, ledger).generate(req, new AbortController().signal))
    const body = (await ledger.get(req.requestId))!.receipt.body
    expect(body.parts).toHaveLength(1)
    const part = body.parts[0]!.body
    expect(part.peerId).toBe(peerId)
    expect(part.requestId).toBe(req.requestId)
    expect(part.inputHash).toBe(requestHash(req))
    expect(part.outputHash).toBe(body.responseHash)
  })

  it('drops a forged part instead of failing the completion', async () => {
    const seed = new Uint8Array(randomBytes(32))
    const other = new Uint8Array(randomBytes(32))
    const peerId = peerIdFromPrivateKey(privateKeyFromRaw(new Uint8Array([...seed, ...publicKeyOf(seed)]))).toString()
    // Signed with another key than the one its peer id names.
    const forger = withReceiptPart(createSimulatedService({ models: ['sim'] }), { peerId, secretKey: other })
    const rejected: number[] = []
    const req = request()
    const events = await drain(withReceipts(forger, ledger, { onRejectedParts: (_, n) => { rejected.push(n) } }).generate(req, new AbortController().signal))
    expect(events.at(-1)?.type).toBe('end')
    expect((await ledger.get(req.requestId))!.receipt.body.parts).toEqual([])
    expect(rejected).toEqual([1])
  })

  it('writes no receipt for a request that fails after start', async () => {
    const service = withReceipts(createSimulatedService({ models: ['sim'], script: { failAfterTokens: 1 } }), ledger)
    const req = request()
    await expect(drain(service.generate(req, new AbortController().signal))).rejects.toMatchObject({ code: expect.any(String) })
    expect(await ledger.get(req.requestId)).toBeUndefined()
  })

  it('a request that cannot be hashed (a lone surrogate) is a 400 before any work, with no receipt and no part (issue 13 #3)', async () => {
    const inner = createSimulatedService({ models: ['sim'], script: { reply: 'abc' } })
    const seed = new Uint8Array(randomBytes(32))
    const peerId = peerIdFromPrivateKey(privateKeyFromRaw(new Uint8Array([...seed, ...publicKeyOf(seed)]))).toString()
    for (const service of [withReceipts(inner, ledger), withReceiptPart(inner, { peerId, secretKey: seed })]) {
      const req = request({ prompt: { kind: 'chat', messages: [{ role: 'user', content: 'a\ud800b' }] } })
      await expect(drain(service.generate(req, new AbortController().signal))).rejects.toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST' })
      expect(await ledger.get(req.requestId)).toBeUndefined()
    }
    expect(inner.calls).toHaveLength(0)
    expect((await ledger.verify()).ok).toBe(true)
  })
})
