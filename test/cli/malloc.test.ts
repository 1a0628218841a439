/**
 * The launcher's glibc malloc settings (scripts/malloc.mjs): which processes re-execute with them
 * and with what environment. The re-execution itself is checked on a running `shoal serve` in
 * test/e2e/cli.test.ts (its /proc environ, same PID).
 */
import { describe, expect, it } from 'vitest'
import { ENGINE_COMMANDS, MALLOC_TUNABLES, mallocTunables } from '../../scripts/malloc.mjs'

const GLIBC = { platform: 'linux', glibc: '2.36' }

describe('mallocTunables', () => {
  it('sets the tunables for every command that runs an engine', () => {
    for (const command of ENGINE_COMMANDS) {
      expect(mallocTunables([command, '--model', 'm'], undefined, GLIBC)).toBe(MALLOC_TUNABLES)
      expect(mallocTunables([command], '', GLIBC)).toBe(MALLOC_TUNABLES)
    }
    expect([...ENGINE_COMMANDS].sort()).toEqual(['demo', 'node', 'serve'])
  })

  it('appends to tunables that set no malloc key', () => {
    expect(mallocTunables(['serve'], 'glibc.cpu.hwcaps=-AVX512F', GLIBC)).toBe(`glibc.cpu.hwcaps=-AVX512F:${MALLOC_TUNABLES}`)
  })

  it('runs as is when malloc is already tuned (the operator, or the re-executed process), off glibc, or for other commands', () => {
    expect(mallocTunables(['serve'], 'glibc.malloc.arena_max=2', GLIBC)).toBeUndefined()
    expect(mallocTunables(['serve'], MALLOC_TUNABLES, GLIBC)).toBeUndefined()
    expect(mallocTunables(['serve'], undefined, { platform: 'linux', glibc: undefined })).toBeUndefined()
    expect(mallocTunables(['serve'], undefined, { platform: 'darwin', glibc: undefined })).toBeUndefined()
    for (const args of [['ca', 'init'], ['shard', '--model', 'm'], ['--version'], []]) expect(mallocTunables(args, undefined, GLIBC)).toBeUndefined()
  })
})
