/**
 * Receipts and receipt parts checked without the project's own signing code: a tiny independent
 * JCS and node:crypto's ed25519 verify, on entries written by a real ledger to a real level db.
 */
import { createHash, createPublicKey, verify as cryptoVerify } from 'node:crypto'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterEach, beforeEach, describe, expect, it } from 'vitest'
import {
  buildReceiptInput, createLedger, createReceiptPart, entryHash, GENESIS_HASH, requestHash, responseHash, verifyReceiptPart,
} from '../../daemon/ledger/index.ts'
import { checkEntry } from '../../daemon/ledger/receipt.ts'
import type { Ledger, SignedReceipt } from '../../daemon/ledger/index.ts'
import type { GenerateRequest } from '../../daemon/service.ts'
import { hex64, makeSigner, sampleInput } from './fixtures/keys.ts'

/** RFC 8785 for the JSON this format uses (finite numbers, strings, arrays, objects, booleans, null). */
function jcs (v: unknown): string {
  if (v === null || typeof v !== 'object') return JSON.stringify(v)
  if (Array.isArray(v)) return `[${v.map(jcs).join(',')}]`
  const o = v as Record<string, unknown>
  const keys = Object.keys(o).filter((k) => o[k] !== undefined).sort()
  return `{${keys.map((k) => `${JSON.stringify(k)}:${jcs(o[k])}`).join(',')}}`
}
const sha256 = (text: string): string => createHash('sha256').update(text, 'utf8').digest('hex')

function independentVerify (doc: { body: unknown, signature: string }, publicKey: Uint8Array): boolean {
  const key = createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x: Buffer.from(publicKey).toString('base64url') }, format: 'jwk' })
  return cryptoVerify(null, Buffer.from(jcs(doc.body), 'utf8'), key, Buffer.from(doc.signature, 'base64url'))
}

const request: GenerateRequest = {
  requestId: 'req-1',
  model: 'demo-tiny',
  prompt: { kind: 'chat', messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Héllo "mesh" \u2603' }] },
  maxTokens: 16,
  sampling: { temperature: 0.7, topP: 0.9, seed: 42 },
  stop: ['\n\n'],
  deadline: 1_900_000_000_000,
}
const output = { text: ' Hi there.', tokenIds: [11, 220, 1734], finishReason: 'stop' as const }

let dir: string
let ledger: Ledger | undefined
beforeEach(async () => { dir = await mkdtemp(join(tmpdir(), 'shoal-ledger-')) })
afterEach(async () => {
  await ledger?.stop()
  ledger = undefined
  await rm(dir, { recursive: true, force: true })
})

describe('receipt hashes', () => {
  it('request hash is sha256 over JCS of {model, prompt, sampling, stop, maxTokens}; transport fields do not count', () => {
    const expected = sha256(jcs({ model: request.model, prompt: request.prompt, sampling: request.sampling, stop: request.stop, maxTokens: 16 }))
    expect(requestHash(request)).toBe(expected)
    expect(requestHash({ ...request, requestId: 'other', deadline: 1 } as GenerateRequest)).toBe(expected)
    expect(requestHash({ ...request, maxTokens: undefined })).toBe(sha256(jcs({ model: request.model, prompt: request.prompt, sampling: request.sampling, stop: request.stop, maxTokens: null })))
    expect(requestHash({ ...request, sampling: { temperature: 0.7, topP: 0.9 } })).not.toBe(expected)
  })

  it('response hash is sha256 over JCS of {text, tokenIds, finishReason}', () => {
    expect(responseHash(output)).toBe(sha256(jcs(output)))
  })
})

describe('receipt parts', () => {
  it('an executor signs its part; it verifies independently and only under its own key', () => {
    const stage = makeSigner()
    const other = makeSigner()
    const part = createReceiptPart({
      requestId: 'req-1', peerId: stage.peerId, model: 'demo-tiny', layers: [4, 7],
      inputHash: hex64(1), outputHash: hex64(2), tokens: { input: 9, output: 16 }, timing: { startedAt: 1_700_000_000_000, durationMs: 12.5 },
    }, stage.secretKey)
    expect(part.body.format).toBe('shoal.receipt-part/1')
    expect(independentVerify(part, stage.publicKey)).toBe(true)
    expect(verifyReceiptPart(part, stage.publicKey)).toBe(true)
    expect(verifyReceiptPart(part, other.publicKey)).toBe(false)
    expect(verifyReceiptPart({ ...part, body: { ...part.body, layers: [4, 8] } }, stage.publicKey)).toBe(false)
    expect(verifyReceiptPart({ body: { nonsense: true }, signature: part.signature }, stage.publicKey)).toBe(false)
    expect(() => createReceiptPart({ ...part.body, inputHash: 'xyz' }, stage.secretKey)).toThrow(/inputHash/)
  })

  it('an expert holder\'s part names the experts it ran per layer; the field is optional, signed and checked', () => {
    const holder = makeSigner()
    const base = {
      requestId: 'req-1', peerId: holder.peerId, model: 'moe', layers: [1, 3] as [number, number],
      inputHash: hex64(1), outputHash: hex64(2), tokens: { input: 12, output: 12 }, timing: { startedAt: 1_700_000_000_000, durationMs: 40 },
    }
    const part = createReceiptPart({ ...base, experts: [{ layer: 1, experts: [0, 5] }, { layer: 3, experts: [2] }] }, holder.secretKey)
    expect(part.body.experts).toEqual([{ layer: 1, experts: [0, 5] }, { layer: 3, experts: [2] }])
    // Signed like every other field: verifies independently, and changing it breaks the signature.
    expect(independentVerify(part, holder.publicKey)).toBe(true)
    expect(verifyReceiptPart(part, holder.publicKey)).toBe(true)
    expect(verifyReceiptPart({ ...part, body: { ...part.body, experts: [{ layer: 1, experts: [0, 6] }, { layer: 3, experts: [2] }] } }, holder.publicKey)).toBe(false)
    // Without it the body is exactly what a pipeline stage signs (no `experts` key at all).
    expect(Object.keys(createReceiptPart(base, holder.secretKey).body)).not.toContain('experts')
    // Shape: non-empty, layers and experts strictly ascending, integers, only {layer, experts}.
    for (const experts of [
      [], [{ layer: 3, experts: [1] }, { layer: 1, experts: [1] }], [{ layer: 1, experts: [] }], [{ layer: 1, experts: [2, 1] }],
      [{ layer: 1, experts: [1, 1] }], [{ layer: 1, experts: [-1] }], [{ layer: 1.5, experts: [1] }],
    ]) expect(() => createReceiptPart({ ...base, experts }, holder.secretKey)).toThrow(/experts/)
    // A caller's extra keys never reach the signed body.
    const extra = createReceiptPart({ ...base, experts: [{ layer: 1, experts: [0], note: 'x' } as never] }, holder.secretKey)
    expect(extra.body.experts).toEqual([{ layer: 1, experts: [0] }])
    expect(verifyReceiptPart({ ...part, body: { ...part.body, experts: [{ layer: 1, experts: [0, 5], x: 1 }, { layer: 3, experts: [2] }] } }, holder.publicKey)).toBe(false)
  })
})

describe('ledger', () => {
  it('appends chained, signed receipts that verify with an independent JCS and node:crypto', async () => {
    const node = makeSigner()
    const stage = makeSigner()
    ledger = createLedger({ dataDir: dir, signer: node })
    await ledger.start()
    const part = createReceiptPart({
      requestId: 'req-1', peerId: stage.peerId, model: 'demo-tiny', layers: [4, 7],
      inputHash: hex64(1), outputHash: hex64(2), tokens: { input: 9, output: 3 }, timing: { startedAt: 1, durationMs: 2 },
    }, stage.secretKey)
    const input = buildReceiptInput(request, output, {
      manifestHash: hex64(9),
      route: [{ peerId: node.peerId, layers: [0, 3] }, { peerId: stage.peerId, layers: [4, 7] }],
      parts: [part],
      usage: { promptTokens: 9, completionTokens: 3 },
      timing: { startedAt: 1_700_000_000_000, firstTokenMs: 8, totalMs: 30 },
    })
    const first = await ledger.append(input)
    const rest = await Promise.all([1, 2, 3, 4].map(async (n) => await ledger!.append(sampleInput(`req-x${n}`, n))))
    const entries: SignedReceipt[] = [first, ...rest.sort((a, b) => a.body.index - b.body.index)]

    let prev = GENESIS_HASH
    entries.forEach((e, i) => {
      expect(e.body.index).toBe(i)
      expect(e.body.signer).toBe(node.peerId)
      expect(e.body.prevHash).toBe(prev)
      expect(independentVerify(e, node.publicKey)).toBe(true)
      prev = sha256(jcs(e))
    })
    expect(first.body.requestHash).toBe(requestHash(request))
    expect(first.body.responseHash).toBe(sha256(jcs(output)))
    expect(independentVerify(first.body.parts[0]!, stage.publicKey)).toBe(true)

    // GET /v1/receipts/{id}: the signed receipt and the signer's certificate, whose key verifies it.
    const got = await ledger.get('req-1')
    expect(got?.receipt).toEqual(first)
    const certKey = Buffer.from((got?.certificate as { body: { publicKey: string } }).body.publicKey, 'base64url')
    expect(independentVerify(got!.receipt, certKey)).toBe(true)
    expect(await ledger.get('nope')).toBeUndefined()

    expect((await ledger.tail(2)).map((e) => e.body.index)).toEqual([3, 4])
    expect(await ledger.verify()).toMatchObject({ ok: true, entries: 5, headHash: prev, signers: [{ peerId: node.peerId, certificate: true }] })
    expect(ledger.size).toBe(5)

    // The chain continues across a restart.
    await ledger.stop()
    ledger = createLedger({ dataDir: dir, signer: node })
    await ledger.start()
    const next = await ledger.append(sampleInput('req-after-restart'))
    expect(next.body).toMatchObject({ index: 5, prevHash: prev })
    expect((await ledger.verify()).ok).toBe(true)
  })

  it('records KV prefix reuse when the executing node reused some of the prompt, and only then', async () => {
    const node = makeSigner()
    ledger = createLedger({ dataDir: dir, signer: node })
    await ledger.start()
    const base = { route: [{ peerId: node.peerId }], usage: { promptTokens: 9, completionTokens: 3 }, timing: { startedAt: 1_700_000_000_000, firstTokenMs: 8, totalMs: 30 } }
    expect(buildReceiptInput(request, output, { ...base, prefix: { peerId: node.peerId, reusedTokens: 0 } }).prefix).toBeUndefined()
    const r = await ledger.append(buildReceiptInput(request, output, { ...base, prefix: { peerId: node.peerId, reusedTokens: 7 } }))
    expect(r.body.prefix).toEqual({ peerId: node.peerId, reusedTokens: 7 })
    expect(independentVerify(r, node.publicKey)).toBe(true)
    expect((await ledger.verify()).ok).toBe(true)
    expect(checkEntry({ ...r, body: { ...r.body, prefix: { peerId: node.peerId, reusedTokens: 0 } } })).toMatch(/prefix/)
    expect(checkEntry({ ...r, body: { ...r.body, prefix: { peerId: node.peerId, reusedTokens: 2, extra: 1 } } })).toMatch(/prefix/)
  })

  it('without a stored certificate the key comes from the ed25519 peer id', async () => {
    const node = makeSigner()
    ledger = createLedger({ dataDir: dir, signer: { peerId: node.peerId, secretKey: node.secretKey } })
    await ledger.start()
    await ledger.append(sampleInput('a'))
    expect((await ledger.get('a'))?.certificate).toBeNull()
    expect(await ledger.verify()).toMatchObject({ ok: true, entries: 1, signers: [{ peerId: node.peerId, certificate: false }] })
    // A caller-supplied key overrides: the wrong one fails.
    const other = makeSigner()
    expect((await ledger.verify({ publicKeyFor: () => other.publicKey })).firstBad).toMatchObject({ index: 0, id: 'a', reason: 'bad-signature' })
  })

  it('refuses bad input, duplicate ids, bad parts, a mismatched signer, and appends when stopped', async () => {
    const node = makeSigner()
    const stranger = makeSigner()
    await expect(createLedger({ dataDir: dir, signer: { ...node, secretKey: stranger.secretKey } }).start()).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_SIGNER' })
    await expect(createLedger({ dataDir: dir, signer: { ...node, certificate: stranger.certificate } }).start()).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_SIGNER' })
    await expect(createLedger({ dataDir: dir, signer: { peerId: 'not-a-peer-id', secretKey: node.secretKey } }).start()).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_SIGNER' })

    ledger = createLedger({ dataDir: dir, signer: node })
    await expect(ledger.append(sampleInput('early'))).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_CLOSED' })
    await ledger.start()
    await expect(ledger.append({ ...sampleInput('x'), requestHash: 'ABC' })).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_INVALID' })
    await expect(ledger.append({ ...sampleInput('x'), usage: { promptTokens: -1, completionTokens: 0 } })).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_INVALID' })
    const forged = createReceiptPart({
      requestId: 'x', peerId: node.peerId, model: 'm', layers: null, inputHash: hex64(1), outputHash: hex64(2),
      tokens: { input: 1, output: 1 }, timing: { startedAt: 0, durationMs: 0 },
    }, stranger.secretKey)
    await expect(ledger.append({ ...sampleInput('x'), parts: [forged] })).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_INVALID', message: /part 0/ })
    // A part signer's certificate is stored with the entry only when it is that signer's and its key signed the part.
    const executor = makeSigner()
    const honest = createReceiptPart({
      requestId: 'x', peerId: executor.peerId, model: 'm', layers: null, inputHash: hex64(1), outputHash: hex64(2),
      tokens: { input: 1, output: 1 }, timing: { startedAt: 0, durationMs: 0 },
    }, executor.secretKey)
    await expect(ledger.append({ ...sampleInput('x'), parts: [honest] }, { certificates: [stranger.certificate] })).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_INVALID', message: /belongs to no part signer/ })
    // Names the executor but certifies the stranger's key.
    const lookalike = { ...stranger.certificate, body: { ...stranger.certificate.body, peerId: executor.peerId } }
    await expect(ledger.append({ ...sampleInput('x'), parts: [honest] }, { certificates: [lookalike] })).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_INVALID', message: /part 0/ })

    const results = await Promise.allSettled([ledger.append(sampleInput('dup')), ledger.append(sampleInput('dup'))])
    expect(results.map((r) => r.status).sort()).toEqual(['fulfilled', 'rejected'])
    await expect(ledger.append(sampleInput('dup'))).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_INVALID', message: /already/ })

    const aborted = new AbortController()
    aborted.abort()
    await expect(ledger.append(sampleInput('y'), { signal: aborted.signal })).rejects.toMatchObject({ code: 'SHOAL_ERR_ABORTED' })
    expect(await ledger.verify()).toMatchObject({ ok: true, entries: 1 })
    await ledger.stop()
    await expect(ledger.append(sampleInput('late'))).rejects.toMatchObject({ code: 'SHOAL_ERR_LEDGER_CLOSED' })
  })

  it('leaves out of a group an id already stored, and chains the rest without a gap', async () => {
    const node = makeSigner()
    ledger = createLedger({ dataDir: dir, signer: node })
    await ledger.start()
    await ledger.append(sampleInput('a'))
    // 'b' starts a group of its own; 'a' and 'c' queue behind it as one group, in which 'a' is
    // found stored and left out, and 'c' follows 'b' as index 2.
    const [b, a, c] = await Promise.allSettled([ledger.append(sampleInput('b')), ledger.append(sampleInput('a')), ledger.append(sampleInput('c'))])
    expect(a).toMatchObject({ status: 'rejected', reason: { code: 'SHOAL_ERR_LEDGER_INVALID', message: /already/ } })
    expect(b).toMatchObject({ status: 'fulfilled', value: { body: { index: 1, id: 'b' } } })
    expect(c).toMatchObject({ status: 'fulfilled', value: { body: { index: 2, id: 'c', prevHash: entryHash((b as PromiseFulfilledResult<SignedReceipt>).value) } } })
    expect(independentVerify((c as PromiseFulfilledResult<SignedReceipt>).value, node.publicKey)).toBe(true)
    expect(await ledger.verify()).toMatchObject({ ok: true, entries: 3 })
    expect((await ledger.get('c'))?.receipt.body.index).toBe(2)
  })

  it('bounds its queue', async () => {
    const node = makeSigner()
    ledger = createLedger({ dataDir: dir, signer: node, maxPending: 4 })
    await ledger.start()
    const results = await Promise.allSettled(Array.from({ length: 12 }, async (_, i) => await ledger!.append(sampleInput(`q${i}`))))
    const refused = results.filter((r) => r.status === 'rejected')
    expect(refused.length).toBeGreaterThan(0)
    for (const r of refused) expect((r as PromiseRejectedResult).reason).toMatchObject({ code: 'SHOAL_ERR_LEDGER_BUSY' })
    expect(await ledger.verify()).toMatchObject({ ok: true, entries: 12 - refused.length })
  })
})
