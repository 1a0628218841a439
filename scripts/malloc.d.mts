// Types for scripts/malloc.mjs (plain JS: scripts/shoal.mjs loads it on any Node).
export declare const ENGINE_COMMANDS: Set<string>
export declare const MALLOC_TUNABLES: string
export declare function mallocTunables (args: readonly string[], current: string | undefined, runtime: { platform: string, glibc: string | undefined }): string | undefined
export declare function glibcVersion (): string | undefined
export declare function execWithMallocTunables (script: string, args: readonly string[]): void
