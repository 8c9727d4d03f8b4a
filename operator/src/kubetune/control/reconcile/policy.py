"""The admins' rules, checked before every launch and every step's pod, not only the first:
`spec.trainerImage` and the Secrets a job names stay mutable, so a job patched while it
runs or is suspended must not get a pod the rules would have refused (docs/security.md)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from kubetune.api.v1alpha1 import GPUPool
from kubetune.api.vocabulary import Reason
from kubetune.control.build.stages import fetched_sources
from kubetune.control.build.storage import input_refs
from kubetune.control.reconcile.context import Context


def refused(ctx: Context) -> bool:
    """Fail a job that asks for what the cluster's admins do not allow (before any GPU
    is spent, and again before each launch and step): a trainer image off the allow-list,
    a Secret its namespace did not allow. True when it failed."""
    image = ctx.spec.trainer_image
    if image is not None and not _image_allowed(ctx, image):
        allowed = [ctx.settings.build.trainer_image, *ctx.settings.allowed_trainer_images]
        ctx.fail(
            Reason.IMAGE_NOT_ALLOWED,
            f"spec.trainerImage {image!r} is not allowed on this cluster (allowed: "
            f"{', '.join(allowed)}). To fix: remove spec.trainerImage to use the "
            "operator's trainer image, or ask the cluster admin to add the image to the "
            "chart value operator.allowedTrainerImages",
        )
        return True
    if _shared_cache_refused(ctx):
        return True
    tenant = ctx.observed.tenant
    if tenant is None:
        return False
    for ref in input_refs(ctx.job):
        refusal = ref.kind == "Secret" and tenant.secret_refusal(ref.name, ref.field)
        if refusal:
            ctx.fail(Reason.SECRET_NOT_ALLOWED, refusal)
            return True
    return False


def _shared_cache_refused(ctx: Context) -> bool:
    """The cluster-wide cache volume is one trust domain: a pod of any namespace can mount
    its volume source (it is in every stage-in and trainer pod spec) and change what the
    others read. Where pools keep namespaces apart, using it needs the admins' consent."""
    settings = ctx.settings
    if settings.build.cache_volume is None or settings.cache_volume_shared_trust:
        return False
    scoped = sorted(
        p.name
        for p in ctx.observed.pools
        if (sel := p.spec.namespace_selector) and (sel.match_labels or sel.match_expressions)
    )
    if not scoped or not fetched_sources(ctx.job, settings.build):
        return False
    ctx.fail(
        Reason.SHARED_CACHE_REFUSED,
        f"this job would fetch its model or data into the cache volume every namespace "
        f"shares (operator.cacheVolume), while GPUPool(s) {', '.join(scoped[:3])} keep "
        "namespaces apart: a pod of any namespace could change what this job reads. To fix: "
        "the cluster admin either removes operator.cacheVolume (each namespace gets its own "
        "cache claim) or sets operator.cacheVolumeSharedTrust=true (the namespaces trust each "
        "other); then create the job again",
    )
    return True


def _image_allowed(ctx: Context, image: str) -> bool:
    if image == ctx.settings.build.trainer_image:
        return True
    return any(fnmatchcase(image, pattern) for pattern in ctx.settings.allowed_trainer_images)


def may_use_pool(ctx: Context, pool: GPUPool) -> bool:
    """Whether the job's namespace may still use `pool` (its spec.namespaceSelector may have
    changed, or the namespace's labels, since the plan was made)."""
    tenant = ctx.observed.tenant
    return tenant is None or tenant.may_use(pool.spec.namespace_selector)
