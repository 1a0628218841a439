/**
 * The error catalogue (daemon/errors.ts) against the source: every SHOAL_ERR_* code written
 * anywhere in the daemon, certs, shards, bin and scripts is in `SHOAL_ERROR_CODES`, every listed
 * code is still used somewhere, and every code has an HTTP status. The compiler checks what is
 * passed to `ShoalError`; this catches codes compared or documented as strings (a typo there is a
 * silent mismatch).
 */
import { readFile, readdir } from 'node:fs/promises'
import { join } from 'node:path'
import { describe, expect, it } from 'vitest'
import { SHOAL_ERROR_CODES, deserializeError, httpStatusOf, httpStatusOfCode, isShoalErrorCode } from '../daemon/errors.ts'
import { REFUSAL_REASONS, certErrorCode, CertificateError } from '../certs/index.ts'

const REPO = join(import.meta.dirname, '..')

async function sourceFiles (dir: string, out: string[] = []): Promise<string[]> {
  for (const e of await readdir(join(REPO, dir), { withFileTypes: true })) {
    const p = join(dir, e.name)
    if (e.isDirectory()) await sourceFiles(p, out)
    else if (/\.(ts|mjs|js)$/.test(e.name) && !e.name.endsWith('.d.mts')) out.push(p)
  }
  return out
}

const files = (await Promise.all(['daemon', 'certs', 'shards', 'bin', 'scripts'].map(async d => await sourceFiles(d)))).flat()
const texts = await Promise.all(files.map(async p => await readFile(join(REPO, p), 'utf8')))
const written = new Set(texts.flatMap(t => [...t.matchAll(/SHOAL_ERR_[A-Z0-9_]+/g)].map(m => m[0])))
/** `SHOAL_ERR_INFER_` and the like: prefixes the source matches codes by (startsWith). */
const prefixes = [...written].filter(c => c.endsWith('_'))
const codes = [...written].filter(c => !c.endsWith('_'))

describe('the error catalogue', () => {
  it('lists every code the source writes', () => {
    expect(codes.length).toBeGreaterThan(50)
    const missing = codes.filter(c => !isShoalErrorCode(c))
    expect(missing).toEqual([])
  })

  it('lists no code the source no longer writes (certificate codes come from their reasons)', () => {
    const fromReasons = new Set<string>(REFUSAL_REASONS.map(certErrorCode))
    const unused = SHOAL_ERROR_CODES.filter(c => !written.has(c) && !fromReasons.has(c))
    expect(unused).toEqual([])
  })

  it('has codes behind every prefix the source matches on', () => {
    for (const p of prefixes) expect(SHOAL_ERROR_CODES.some(c => c.startsWith(p)), p).toBe(true)
  })

  it('gives every code an HTTP status; codes it does not list are 500', () => {
    expect(new Set(SHOAL_ERROR_CODES).size).toBe(SHOAL_ERROR_CODES.length)
    for (const c of SHOAL_ERROR_CODES) {
      const { status, type } = httpStatusOfCode(c)
      expect(status, c).toBeGreaterThanOrEqual(400)
      expect(['invalid_request_error', 'rate_limit_error', 'server_error'], c).toContain(type)
    }
    expect(httpStatusOf({ code: 'SHOAL_ERR_FROM_A_NEWER_PEER' })).toEqual({ status: 500, type: 'server_error' })
    expect(httpStatusOf(new Error('plain'))).toEqual({ status: 500, type: 'server_error' })
  })

  it('keeps a peer\'s code it does not list as it came', () => {
    const err = deserializeError({ name: 'FutureError', code: 'SHOAL_ERR_FROM_A_NEWER_PEER', message: 'm' })
    expect(err.code).toBe('SHOAL_ERR_FROM_A_NEWER_PEER')
    expect(err.name).toBe('FutureError')
  })

  it('maps each certificate refusal reason to its SHOAL_ERR_CERT_<REASON> code', () => {
    for (const reason of REFUSAL_REASONS) {
      const code = certErrorCode(reason)
      expect(code).toBe(`SHOAL_ERR_CERT_${reason.toUpperCase().replaceAll('-', '_')}`)
      expect(new CertificateError(reason, 'm').code).toBe(code)
    }
    expect(new CertificateError('file', 'm').code).toBe('SHOAL_ERR_CERT_FILE')
  })
})
